"""One training step of a Llama-3-8B-shaped model under fake execution, on this machine.

    python benchmarks/fake_llama8b.py                 # 1 step, h100-80gb, full shape
    python benchmarks/fake_llama8b.py --layers 4      # a quicker, shallower run
    python benchmarks/fake_llama8b.py --plan tp=8,shard=zero3,world=64 --rank 9
                                                      # one rank of a 2-D plan

Shape: dim 4096, 32 layers, 32 heads, 8 KV heads, FFN 14336, vocab 128256 (RMSNorm,
RoPE, grouped-query attention through F.scaled_dot_product_attention, SwiGLU, untied
output head); batch 1, sequence 2048, autocast bf16, per-layer non-reentrant
checkpointing, AdamW (CUDA default: foreach).  The model is built the way a user builds
one for a GPU (on the CPU, then ``.cuda()``), inside fake execution, so nothing is
allocated: a step costs Python dispatch, not FLOPs.

Prints wall time (model build and step separately), peak RSS of this process, the peak
live fake bytes of the step, and the model-state bytes that must be in it (16 bytes per
parameter: fp32 parameters, gradients, two AdamW states) as a cross-check.  Issue 10
asks for <= 60 s and <= 2 GiB RSS on the 2-core project machine.

``--plan tp=T,shard=zero3,world=W`` runs the step as rank ``--rank`` of that plan on the
fake process group, realised by ``memadvisor.apply``'s own functions (the ground truth a
prediction is checked against): ``tensor_parallel.apply_tensor_parallel`` splits the
attention and MLP Linears over the (W/T, T) DeviceMesh's ``tp`` dimension (Megatron
styles), then ``sharding.wrap_model`` applies FSDP2 ``fully_shard`` over its ``dp``
dimension to each block and the root; AdamW steps tensor by tensor
(``tensor_parallel.without_foreach``, as apply does).  The model is built on the (fake)
CPU and moved by those two, so no rank ever holds the whole model on its GPU; the live
bytes' window restarts after the build, so each step's peak is the step's own.  The
cross-check is then per rank: 16 B per parameter of the split Linears / W (split over T,
sharded over W/T), and of the replicated parts (embedding, head, norms) / (W/T).  Issue 14
asks for ``tp=8,shard=zero3,world=64`` under 2 minutes on this machine.
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GiB = 1024**3


def build_model_classes():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    class RMSNorm(nn.Module):
        def __init__(self, dim, eps=1e-5):
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x):
            x32 = x.float()
            return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
                    ).type_as(x) * self.weight

    def rope(x, cos, sin):
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    class Attention(nn.Module):
        def __init__(self, dim, heads, kv_heads):
            super().__init__()
            # n_heads / n_kv_heads: the names tp divides (torchtitan's), as the forward
            # reshapes into this rank's heads
            self.n_heads, self.n_kv_heads, self.head_dim = heads, kv_heads, dim // heads
            self.wq = nn.Linear(dim, dim, bias=False)
            self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
            self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
            self.wo = nn.Linear(dim, dim, bias=False)

        def forward(self, x, cos, sin):
            batch, seq, _ = x.shape
            q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
            k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
            v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    class Block(nn.Module):
        def __init__(self, dim, heads, kv_heads, ffn):
            super().__init__()
            self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
            self.attention = Attention(dim, heads, kv_heads)
            self.w1 = nn.Linear(dim, ffn, bias=False)
            self.w2 = nn.Linear(ffn, dim, bias=False)
            self.w3 = nn.Linear(dim, ffn, bias=False)

        def forward(self, x, cos, sin):
            x = x + self.attention(self.attention_norm(x), cos, sin)
            h = self.ffn_norm(x)
            return x + self.w2(F.silu(self.w1(h)) * self.w3(h))

    class Llama(nn.Module):
        def __init__(self, vocab, dim, layers, heads, kv_heads, ffn):
            super().__init__()
            self.head_dim = dim // heads
            self.embed = nn.Embedding(vocab, dim)
            self.layers = nn.ModuleList(Block(dim, heads, kv_heads, ffn)
                                        for _ in range(layers))
            self.norm = RMSNorm(dim)
            self.output = nn.Linear(dim, vocab, bias=False)

        def forward(self, tokens):
            seq = tokens.shape[1]
            position = torch.arange(seq, device=tokens.device, dtype=torch.float32)
            inv_freq = 1.0 / (500000.0 ** (torch.arange(0, self.head_dim, 2,
                                                        device=tokens.device) / self.head_dim))
            angles = torch.outer(position, inv_freq).repeat(1, 2)
            cos, sin = angles.cos(), angles.sin()
            x = self.embed(tokens)
            for layer in self.layers:
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            return self.output(self.norm(x))

    return Llama


LLAMA3_8B = dict(vocab=128256, dim=4096, layers=32, heads=32, kv_heads=8, ffn=14336)


def model_state_bytes_per_rank(model, split_paths, plan) -> dict[str, int]:
    """What the cross-check expects on one rank: 16 B per parameter (fp32 parameter,
    gradient, two AdamW states), the split Linears' divided over all ``world`` ranks (T
    tensor-parallel x world/T FSDP), the rest (replicated over tp) over world/T ranks.
    ``model``: the model before the plan (plain tensors, whole)."""
    split = replicated = 0
    for name, parameter in model.named_parameters():
        if name.rpartition(".")[0] in split_paths:
            split += parameter.numel()
        else:
            replicated += parameter.numel()
    shard_ranks = plan.data_parallel_size if plan.uses_fsdp else 1
    return {"split_parameters": split, "replicated_parameters": replicated,
            "split_bytes": 16 * split // (plan.tp * shard_ranks),
            "replicated_bytes": 16 * replicated // shard_ranks}


def run_steps(*, plan_text: str = "none", rank: int = 0, gpu: str = "h100-80gb",
              seq: int = 2048, steps: int = 1, shape: dict | None = None) -> dict:
    """The benchmark's body: build, (realise the plan,) train ``steps`` steps under fake
    execution as ``rank``; returns the figures (times in s, bytes)."""
    t_start = time.perf_counter()
    import memadvisor.fake as fake
    fake.preload()
    from memadvisor.fake.runtime import fake_execution
    from memadvisor.plan import Plan
    import torch
    import torch.nn.functional as F
    Llama = build_model_classes()
    plan = Plan.parse_spec(plan_text)
    shape = dict(LLAMA3_8B if shape is None else shape)
    t_imported = time.perf_counter()

    out: dict = {"plan": str(plan), "rank": rank, "shape": shape, "seq": seq}
    with fake_execution(gpu=gpu, nproc=plan.world, rank=rank) as run:
        model = Llama(**shape)
        out["parameter_count"] = sum(p.numel() for p in model.parameters())
        if plan.world > 1:
            _realise(model, plan, out)
        else:
            model = model.cuda()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        if plan.tp > 1:
            from memadvisor.apply.tensor_parallel import without_foreach
            without_foreach(optimizer)
        out["build_peak_bytes"] = run.live_bytes.reset_window(run.device_index)
        t_built = time.perf_counter()
        for _ in range(steps):
            tokens = torch.randint(0, shape["vocab"], (1, seq + 1)).cuda()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(tokens[:, :-1])
            if hasattr(logits, "full_tensor"):  # not with these styles: the head stays whole
                logits = logits.full_tensor()
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del logits, loss  # so what is live after the step is the model states alone
        t_done = time.perf_counter()
        out["device_name"] = run.gpu.device_name
        out["step_peak_bytes"] = list(run.step_peak_bytes)
        out["live_bytes_after"] = run.live_bytes.allocated_bytes(run.device_index)
    out["rss_peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out["seconds"] = {"import": t_imported - t_start, "build": t_built - t_imported,
                      "steps": t_done - t_built, "total": t_done - t_start}
    return out


def _realise(model, plan, out: dict) -> None:
    """``plan`` on ``model`` (built on the fake CPU) with apply's own realisation: tp over
    the mesh's tp dimension, then FSDP2 over its dp dimension, per block and the root."""
    import torch.distributed as dist
    from memadvisor.apply import sharding, tensor_parallel
    from memadvisor.plan import repeated_blocks
    from memadvisor.apply.checkpointing import module_entries
    dist.init_process_group("nccl")  # the fake group, as this rank of plan.world
    layout = tensor_parallel.apply_tensor_parallel(model, plan, "cuda")
    split_paths = set(layout.split_paths()) if layout is not None else set()
    # DTensor parameters count their global elements: the cross-check sees the whole model
    out.update(model_state_bytes_per_rank(model, split_paths, plan))
    blocks = repeated_blocks(module_entries(model)) if plan.uses_fsdp else []
    sharding.wrap_model(model, plan, "cuda", blocks)
    out["fsdp_units"] = len(blocks) + 1 if plan.uses_fsdp else 0


def report(out: dict) -> str:
    seconds = out["seconds"]
    shape = out["shape"]
    lines = [f"model: {out['parameter_count'] / 1e9:.2f} B parameters, {shape['layers']} layers, "
             f"seq {out['seq']}, on {out['device_name']} (fake); plan {out['plan']}, "
             f"rank {out['rank']}",
             f"wall time: import + shim {seconds['import']:.1f} s, build (and plan) "
             f"{seconds['build']:.1f} s, {len(out['step_peak_bytes'])} step(s) "
             f"{seconds['steps']:.1f} s, total {seconds['total']:.1f} s",
             f"peak RSS: {out['rss_peak_bytes'] / GiB:.2f} GiB",
             f"build: peak live fake CUDA bytes {out['build_peak_bytes']:,}"]
    if "split_bytes" in out:
        states = out["split_bytes"] + out["replicated_bytes"]
        lines.append(
            f"model states per rank (16 B/parameter): split Linears "
            f"{out['split_parameters']:,} parameters -> {out['split_bytes']:,} B, replicated "
            f"{out['replicated_parameters']:,} -> {out['replicated_bytes']:,} B; "
            f"{states:,} B ({states / GiB:.2f} GiB)")
        # FSDP's root unit (embedding, head, final norm) is all-gathered for the whole
        # forward and backward: its fp32 parameters and gradients whole on every rank
        root_parameters = 2 * shape["vocab"] * shape["dim"] + shape["dim"]
        lines.append(f"  a term of the peak (modelled, not measured): the root unit unsharded, "
                     f"8 B x {root_parameters:,} parameters = {8 * root_parameters:,} B "
                     f"({8 * root_parameters / GiB:.2f} GiB); the second step's peak adds "
                     f"the AdamW states made in the first ({states // 2:,} B)")
    else:
        states = 16 * out["parameter_count"]
        lines.append(f"model states alone (16 B/parameter): {states:,} B ({states / GiB:.2f} GiB)")
    for step, peak in enumerate(out["step_peak_bytes"], 1):
        lines.append(f"step {step}: peak live fake CUDA bytes {peak:,} ({peak / GiB:.2f} GiB); "
                     f"the rest over model states {(peak - states) / GiB:.2f} GiB")
    # gradients are set to None after the step: parameters and the two AdamW states stay
    expected_after = states * 12 // 16
    lines.append(f"live after the last step: {out['live_bytes_after']:,} B; cross-check "
                 f"12 B/parameter (gradients freed) {expected_after:,} B, measured / expected "
                 f"{out['live_bytes_after'] / expected_after:.4f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", default="h100-80gb")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--plan", default="none",
                        help="a memadvisor plan, e.g. tp=8,shard=zero3,world=64")
    parser.add_argument("--rank", type=int, default=0, help="which rank of the plan to run")
    args = parser.parse_args(argv)
    out = run_steps(plan_text=args.plan, rank=args.rank, gpu=args.gpu, seq=args.seq,
                    steps=args.steps, shape=dict(LLAMA3_8B, layers=args.layers))
    print(report(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
