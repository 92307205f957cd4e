"""Fake-execution checks that need a fresh process (the shim loads before torch).

``python child.py CASE`` prints one JSON object on its last stdout line; the tests in this
folder run it in a subprocess and assert on the figures.  Cases:

    train   tests/fake/scripts/tiny_train.py under fake_execution(gpu='h100-80gb'), plus
            the probes below (placeholders, lifetimes, module moves, refusal)
    fsdp    FSDP2 fully_shard over 2 fake ranks, one step, as rank 1
    late    torch imported before fake_execution: the refusal's message
    tp_zero3  benchmarks/fake_llama8b.py's step at a tiny Llama shape as rank 1 of
            tp=2,shard=zero3,world=4 (apply's tp and FSDP2 realisation), plus the
            parameter moves it needed (``param.data = moved``, small Parameters)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the checkout, ahead of any installed copy


def case_train() -> dict:
    import memadvisor.fake as fake
    shim = fake.preload()
    torch_imported_by_preload = "torch" in sys.modules
    from memadvisor.fake.runtime import run_script

    out: dict = {"torch_imported_by_preload": torch_imported_by_preload}
    run = run_script(HERE / "scripts" / "tiny_train.py", gpu="h100-80gb")
    import torch
    out["hooks_active"], out["guard_active"] = shim.hooks_active, shim.guard_active
    out["step_peak_bytes"] = run.step_peak_bytes
    out["placeholders"] = [(u.op, u.location, u.value) for u in run.placeholder_log.uses]
    out.update(_probe_script_module())
    out.update(_probe_values())
    out.update(_probe_lifetimes())
    out.update(_probe_real_module())
    out.update(_probe_refusal())
    out.update(_probe_data_loading())
    out.update(_probe_attention())
    out.update(_probe_deepcopy())
    out["cuda_available_after"] = torch.cuda.is_available()
    return out


def _probe_script_module() -> dict:
    """The script imported as a module (so its OBSERVED dict can be read back)."""
    sys.path.insert(0, str(HERE / "scripts"))
    import tiny_train
    from memadvisor.fake.runtime import fake_execution
    with fake_execution(gpu="a100-40gb") as run:
        import torch
        tiny_train.main(steps=2)
        props = torch.cuda.get_device_properties(0)
    observed = {k: (str(v) if not isinstance(v, (list, bool, int, float)) else v)
                for k, v in tiny_train.OBSERVED.items()}
    param_bytes = sum(p.numel() * p.element_size()
                      for p in tiny_train.TinyLM().parameters())
    return {"observed": observed, "param_bytes": param_bytes,
            "a100_props": [props.name, props.total_memory, props.major, props.minor],
            "a100_step_peak_bytes": run.step_peak_bytes}


def _probe_values() -> dict:
    from memadvisor.fake.runtime import fake_execution
    with fake_execution() as run:
        import torch
        x = torch.randn(3, 4, device="cuda")
        values = {
            "item_float": x.sum().item(),
            "item_int": x.long().sum().item(),
            "bool": bool(x.sum() > 0),
            "tolist": x[0].tolist(),
            "allclose": torch.allclose(x, x),
            "nonzero_shape": list(x.nonzero().shape),
        }
        if x.sum() > 100:  # a data-dependent branch: taken, and its line recorded
            values["branch_taken"] = True
    values["placeholder_lines"] = [u.location.rsplit(":", 1)[1] for u in run.placeholder_log.uses]
    return {"values": values}


def _probe_lifetimes() -> dict:
    from memadvisor.fake.runtime import fake_execution
    with fake_execution() as run:
        import torch
        before = torch.cuda.memory_allocated()
        x = torch.empty(1024, device="cuda")  # 4096 B
        view = x[:10]
        with_x = torch.cuda.memory_allocated()
        del x
        with_view_only = torch.cuda.memory_allocated()
        del view
        after = torch.cuda.memory_allocated()
        cpu = torch.empty(1 << 20)  # host memory: not the GPU's
        with_cpu = torch.cuda.memory_allocated()
        del cpu
    return {"lifetimes": [before, with_x, with_view_only, after, with_cpu]}


def _probe_real_module() -> dict:
    """A module built before fake execution (real CPU parameters) moved with .cuda()."""
    import torch
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10))
    model[1].weight = model[0].weight
    from memadvisor.fake.runtime import fake_execution
    with fake_execution():
        model.cuda()
        devices = sorted({str(p.device) for p in model.parameters()})
        tied = model[1].weight is model[0].weight
        loss = model(torch.tensor([[1, 2, 3]]).cuda()).float().pow(2).mean()
        loss.backward()
        grad_device = str(model[0].weight.grad.device)
    return {"real_module": {"devices": devices, "tied": tied, "grad_device": grad_device,
                            "weight_device_after": str(model[0].weight.device)}}


def _probe_deepcopy() -> dict:
    """A real tensor (made before fake execution, as a library's module-level buffer is)
    deep-copied under it stays real with its values; a fake one stays fake."""
    import copy

    import torch
    from torch._subclasses.fake_tensor import is_fake
    real = torch.arange(3.0)
    from memadvisor.fake.runtime import fake_execution
    with fake_execution():
        copied = copy.deepcopy({"state": real})["state"]
        fake = torch.ones(2, device="cuda")
        fake_copy = copy.deepcopy(fake)
        return {"deepcopy": {"real_stays_real": not is_fake(copied),
                             "values": copied.tolist(), "fake_stays_fake": is_fake(fake_copy),
                             "fake_device": str(fake_copy.device)}}


def _probe_attention() -> dict:
    """Which kernel SDPA runs on each target, and the bytes alive after its forward."""
    import torch
    import torch.nn.functional as F
    from memadvisor.fake.runtime import fake_execution
    out = {}
    for gpu in ("h100-80gb", "v100-32gb"):
        for name, dtype, masked in (("bf16", torch.bfloat16, False), ("fp32", torch.float32, False),
                                    ("bf16_mask", torch.bfloat16, True)):
            with fake_execution(gpu=gpu):
                q = torch.randn(1, 4, 2048, 64, device="cuda", dtype=dtype, requires_grad=True)
                mask = torch.ones(2048, 2048, device="cuda", dtype=torch.bool).tril() \
                    if masked else None
                before = torch.cuda.memory_allocated()
                y = F.scaled_dot_product_attention(q, q, q, attn_mask=mask,
                                                   is_causal=mask is None)
                kept = torch.cuda.memory_allocated() - before  # output + what backward saves
                y.sum().backward()
                out[f"{gpu}/{name}"] = kept
            with fake_execution(gpu=gpu):  # the script's own switch is honoured
                torch.backends.cuda.enable_flash_sdp(False)
                try:
                    q = torch.randn(1, 4, 2048, 64, device="cuda", dtype=torch.bfloat16,
                                    requires_grad=True)
                    before = torch.cuda.memory_allocated()
                    y = F.scaled_dot_product_attention(q, q, q, is_causal=True)
                    out[f"{gpu}/bf16_flash_off"] = torch.cuda.memory_allocated() - before
                finally:
                    torch.backends.cuda.enable_flash_sdp(True)
    return {"attention_kept_bytes": out}


def _probe_refusal() -> dict:
    import torch
    from memadvisor.fake.mode import FakeOpUnsupported
    from memadvisor.fake.runtime import fake_execution

    # a custom kernel with a CPU/CUDA implementation and no fake one, as an extension has
    @torch.library.custom_op("memadvisor_test::mystery_kernel", mutates_args=(),
                             schema="(Tensor x) -> Tensor")
    def mystery_kernel(x):
        return x.clone()

    with fake_execution():
        x = torch.randn(4, device="cuda")
        try:
            mystery_kernel(x)
            return {"refusal": None}
        except FakeOpUnsupported as exc:
            return {"refusal": [exc.op, str(exc)]}


def _probe_data_loading() -> dict:
    """DataLoader workers (forked inside fake execution) and pinned memory, then to the fake
    GPU.  The dataset is real (loaded before, as from disk): its batches stay real."""
    import numpy as np
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils.data import DataLoader, TensorDataset
    from memadvisor.fake.runtime import fake_execution
    dataset = TensorDataset(torch.from_numpy(np.arange(32, dtype=np.float32).reshape(8, 4)))
    with fake_execution():
        model = torch.nn.Linear(4, 2).cuda()
        seen = []
        for workers in (0, 2):
            loader = DataLoader(dataset, batch_size=4, num_workers=workers, pin_memory=True)
            for (batch,) in loader:
                out = model(batch.to("cuda", non_blocking=True))
                seen.append([workers, str(batch.device), str(out.device), list(out.shape)])
        batch = next(iter(DataLoader(dataset, batch_size=4, num_workers=1)))[0]
        with unset_fake_temporarily():
            # a real batch keeps its values (a fake one would only have placeholders)
            first_value = float(batch[1, 0]) if type(batch) is torch.Tensor else None
    return {"data_loading": seen, "worker_batch_value": first_value}


def case_fsdp() -> dict:
    import memadvisor.fake as fake
    fake.preload(2)
    from memadvisor.fake.runtime import fake_execution
    with fake_execution(gpu="h100-80gb", nproc=2, rank=1) as run:
        import os
        import torch
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor
        dist.init_process_group("nccl")  # the script asks for NCCL; it gets the fake group
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                    torch.nn.Linear(256, 64)).cuda()
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters())
        batch = torch.randn(8, 64, device="cuda", requires_grad=True)
        # runs on the autograd engine's thread for cuda:1, which set its device in C++
        seen_in_backward = []
        batch.register_hook(lambda grad: seen_in_backward.append(
            (torch.cuda.current_device(), str(torch.empty(1, device="cuda").device))))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(batch).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        weight = model[0].weight
        out = {"backend": dist.get_backend(), "world_size": dist.get_world_size(),
               "rank": dist.get_rank(), "is_dtensor": isinstance(weight, DTensor),
               "local_shape": list(weight.to_local().shape),
               "global_shape": list(weight.shape),
               "current_device": torch.cuda.current_device(),
               "seen_in_backward": seen_in_backward}
    out["step_peak_bytes"] = run.step_peak_bytes
    out["initialized_after"] = dist.is_initialized()
    return out


def case_late() -> dict:
    import torch  # noqa: F401  (first: too early for the shim)
    from memadvisor.fake.runtime import fake_execution
    from memadvisor.fake.shim import FakeCudaUnavailable
    try:
        with fake_execution():
            pass
    except FakeCudaUnavailable as exc:
        return {"refused": str(exc)}
    return {"refused": None}


TINY_LLAMA = dict(vocab=256, dim=64, layers=2, heads=4, kv_heads=2, ffn=128)


def case_tp_zero3() -> dict:
    sys.path.insert(0, str(HERE.parents[1] / "benchmarks"))
    import fake_llama8b
    out = fake_llama8b.run_steps(plan_text="tp=2,shard=zero3,world=4", rank=1, seq=16,
                                 steps=2, shape=TINY_LLAMA)
    out.update(_probe_parameter_moves())
    return out


def _probe_parameter_moves() -> dict:
    """A small Parameter made under fake execution (its ``torch.ones`` alone would run for
    real on the CPU) is fake; ``tensor.data = tensor.to('cuda')`` moves its device too."""
    from memadvisor.fake.runtime import fake_execution
    with fake_execution(gpu="h100-80gb") as run:
        import torch
        from torch._subclasses.fake_tensor import is_fake
        weight = torch.nn.Parameter(torch.ones(8))
        ones_is_real = not is_fake(torch.ones(8))
        weight.data = weight.to("cuda")
        moved = [str(weight.device), is_fake(weight), run.live_bytes.allocated_bytes(0)]
    return {"small_parameter_ones_real": ones_is_real, "small_parameter_moved": moved,
            "data_property_restored": "data" not in torch._subclasses.fake_tensor.FakeTensor.__dict__}


if __name__ == "__main__":
    result = {"train": case_train, "fsdp": case_fsdp, "late": case_late,
              "tp_zero3": case_tp_zero3}[sys.argv[1]]()
    print(json.dumps(result))
