"""Optimizer offload without sharding (ZeRO-Offload's layout): state and step on the host.

The optimizer the plan asks for runs over fp32 copies of the parameters in pinned host
memory.  ``step`` copies the gradients down, steps on the CPU, and copies the parameters
back up.  To the script (and to ``GradScaler``, ``clip_grad_norm_`` and LR schedulers) it
is an ordinary ``torch.optim.Optimizer`` whose ``param_groups`` hold the GPU parameters;
hyperparameters a scheduler changes there are passed to the host optimizer at each step.
With FSDP (zero2/zero3) offload is FSDP2's ``CPUOffloadPolicy`` instead (see sharding).
"""
from __future__ import annotations

import torch


class HostOptimizer(torch.optim.Optimizer):
    def __init__(self, groups: list[dict], optimizer_class, defaults: dict):
        super().__init__(groups, {})
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        host_groups = []
        for group in self.param_groups:
            host_params = []
            for param in group["params"]:
                host = param.detach().to("cpu", torch.float32, copy=True)
                if torch.cuda.is_available():
                    host = host.pin_memory()
                host.requires_grad_(True)
                self._pairs.append((param, host))
                host_params.append(host)
            host_groups.append({**{k: v for k, v in group.items() if k != "params"},
                                "params": host_params})
        from .optimizers import construct
        self.host_optimizer = construct(optimizer_class, host_groups, defaults)
        # the host optimizer's state is what there is to checkpoint
        self.state = self.host_optimizer.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group, host_group in zip(self.param_groups, self.host_optimizer.param_groups):
            host_group.update({k: v for k, v in group.items() if k != "params"})
        for param, host in self._pairs:
            if param.grad is None:
                host.grad = None
                continue
            if host.grad is None:
                host.grad = torch.empty_like(host, pin_memory=host.is_pinned())
            host.grad.copy_(param.grad, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the gradient copies must land before the CPU reads them
        self.host_optimizer.step()
        for param, host in self._pairs:
            param.copy_(host, non_blocking=True)
        return loss

    def state_dict(self):
        return self.host_optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.host_optimizer.load_state_dict(state_dict)
