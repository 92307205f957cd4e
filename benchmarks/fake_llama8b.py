"""One training step of a Llama-3-8B-shaped model under fake execution, on this machine.

    python benchmarks/fake_llama8b.py                 # 1 step, h100-80gb, full shape
    python benchmarks/fake_llama8b.py --layers 4      # a quicker, shallower run

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
            self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
            self.wq = nn.Linear(dim, dim, bias=False)
            self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
            self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
            self.wo = nn.Linear(dim, dim, bias=False)

        def forward(self, x, cos, sin):
            batch, seq, _ = x.shape
            q = self.wq(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
            k = self.wk(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
            v = self.wv(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", default="h100-80gb")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args(argv)

    t_start = time.perf_counter()
    import memadvisor.fake as fake
    fake.preload()
    from memadvisor.fake.runtime import fake_execution
    import torch
    import torch.nn.functional as F
    Llama = build_model_classes()
    t_imported = time.perf_counter()

    with fake_execution(gpu=args.gpu) as run:
        model = Llama(vocab=128256, dim=4096, layers=args.layers, heads=32, kv_heads=8,
                      ffn=14336).cuda()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        parameter_count = sum(p.numel() for p in model.parameters())
        t_built = time.perf_counter()
        for _ in range(args.steps):
            tokens = torch.randint(0, 128256, (1, args.seq + 1)).cuda()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            print(f"loss {loss.item()} (a placeholder: no data under fake execution)")
        t_done = time.perf_counter()

    rss_peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model_state_bytes = 16 * parameter_count
    print(f"model: {parameter_count / 1e9:.2f} B parameters, {args.layers} layers, "
          f"seq {args.seq}, on {run.gpu.device_name} (fake)")
    print(f"wall time: import + shim {t_imported - t_start:.1f} s, build "
          f"{t_built - t_imported:.1f} s, {args.steps} step(s) {t_done - t_built:.1f} s, "
          f"total {t_done - t_start:.1f} s")
    print(f"peak RSS: {rss_peak_bytes / GiB:.2f} GiB")
    for step, peak in enumerate(run.step_peak_bytes, 1):
        print(f"step {step}: peak live fake CUDA bytes {peak:,} ({peak / GiB:.2f} GiB); "
              f"model states alone (16 B/parameter) {model_state_bytes / GiB:.2f} GiB; "
              f"the rest {(peak - model_state_bytes) / GiB:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
