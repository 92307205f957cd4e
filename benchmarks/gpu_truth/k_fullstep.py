"""The writer of the K_memory_ctx128_{fullstep,forward} snapshots, re-implemented.

    python benchmarks/gpu_truth/k_fullstep.py [--forward-only] [--snapshot PATH]
    python benchmarks/gpu_truth/k_fullstep.py --d-model 64 --num-layers 2 --d-ff 128 \
        --num-heads 4 --vocab-size 100 --context-length 16        # tiny, on CPU

Original: github kkaitlyn111/cs336-a2-systems, ``cs336_systems/benchmark.py``
``run_memory_foward_fullstep`` (commit c1c174d, 2025-05-31), with the student's
``TransformerLM``, ``AdamW`` and ``cross_entropy_loss`` from kkaitlyn111/cs336-assignment1.
Neither repository has a licence, so nothing here is copied from them: this file was written
from what they do (read from their stored versions and checked against the allocations and
Python line numbers in the snapshot), on top of the MIT-licensed ``cs336_basics`` package
beside it (the W snapshots' model, the same assignment's architecture).  Every way the
student's code differs from that package, in what it allocates, is said where it is
reproduced below.  README.md lists what still differs from the original.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.nn as nn
from einops import einsum, rearrange

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from cs336_basics.model import Embedding, Linear, RMSNorm  # noqa: E402
from cs336_basics.nn_utils import softmax  # noqa: E402
from cs336_basics.optimizer import AdamW  # noqa: E402

# benchmark.py get_model_config("2.7b"); vocab 10,000, RoPE theta 10,000, batch 4, context 128
CONFIG_2_7B = dict(d_model=2560, d_ff=10240, num_layers=32, num_heads=32, vocab_size=10_000)
BATCH_SIZE = 4
ROPE_THETA = 10_000.0


class StudentLinear(Linear):
    # the package: einsum(x, weight); the student: einsum(weight, x) (weight [out, in] in
    # both).  One output block either way.
    def forward(self, x):
        return einsum(self.weight, x, "d_out d_in, ... d_in -> ... d_out")


class StudentRMSNorm(RMSNorm):
    # the package: rsqrt(mean(x^2) + eps), x * rms, weight * x.  The student: a vector norm,
    # norm^2 / d + eps, sqrt (four small [b, s, 1] temporaries), then two full-size tensors,
    # x / rms and the weight product, both kept for backward.
    def forward(self, x):
        in_dtype = x.dtype
        x = x.to(torch.float32)
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        rms = torch.sqrt(norm**2 / self.weight.shape[0] + self.eps)
        normed = x / rms
        return einsum(self.weight, normed, "d, b s d -> b s d").to(in_dtype)


class StudentRoPE(nn.Module):
    # the package: one RotaryEmbedding shared by all layers, cos/sin sliced (views), halves
    # rotated and concatenated.  The student: one cos/sin buffer per attention layer
    # ([max_seq_len, d_k/2, 2]), cos and sin gathered by a [batch, seq] position tensor (two
    # [b, s, d_k/2] copies per call), a zeros_like output written pair by pair (each half:
    # three [b, h, s, d_k/2] temporaries, freed at once).
    def __init__(self, theta: float, d_k: int, max_seq_len: int):
        super().__init__()
        self.d_k = d_k
        positions = torch.arange(max_seq_len)
        inverse_frequencies = 1.0 / (theta ** (torch.arange(0, d_k, 2).float() / d_k))
        angles = torch.outer(positions, inverse_frequencies)
        self.register_buffer("cos_sin", torch.stack((torch.cos(angles), torch.sin(angles)), dim=-1),
                             persistent=False)

    def forward(self, x, token_positions):
        pairs = rearrange(x, "... (half two) -> ... half two", two=2)
        cos = self.cos_sin[token_positions, :, 0].unsqueeze(1)
        sin = self.cos_sin[token_positions, :, 1].unsqueeze(1)
        rotated = torch.zeros_like(pairs)  # keeps x's permuted strides: the reshape is a view
        rotated[..., 0] = cos * pairs[..., 0] - sin * pairs[..., 1]
        rotated[..., 1] = sin * pairs[..., 0] + cos * pairs[..., 1]
        return rotated.reshape(x.shape)


def student_attention(q, k, v, mask):
    # the package: einops einsum, torch.where against a [s, s] mask.  The student: torch.einsum
    # over the head-permuted q, k, v (each copied contiguous first), a division, then
    # ``mask == False`` on the mask expanded to [b, h, s, s] (a full-size bool tensor) and an
    # out-of-place masked_fill.
    scores = torch.einsum("...qd,...kd->...qk", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(mask == False, -1e9)  # noqa: E712  (the student's spelling)
    weights = softmax(scores, dim=-1)  # same operations as the student's own softmax
    return torch.einsum("...qk,...kd->...qd", weights, v)


class StudentAttention(nn.Module):
    def __init__(self, d_model: int, num_heads: int, max_seq_len: int, theta: float):
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = StudentLinear(d_model, d_model)
        self.k_proj = StudentLinear(d_model, d_model)
        self.v_proj = StudentLinear(d_model, d_model)
        self.output_proj = StudentLinear(d_model, d_model)
        self.rope = StudentRoPE(theta, d_model // num_heads, max_seq_len)

    def forward(self, x):
        # one local per intermediate, as the student has them: what a local holds is freed
        # when it is rebound or when forward returns, not earlier
        batch_size, seq_len, _ = x.shape
        q_x = self.q_proj(x)
        k_x = self.k_proj(x)
        v_x = self.v_proj(x)
        q = rearrange(q_x, "b s (h d) -> b h s d", h=self.num_heads)
        k = rearrange(k_x, "b s (h d) -> b h s d", h=self.num_heads)
        v = rearrange(v_x, "b s (h d) -> b h s d", h=self.num_heads)
        # positions made on every call (the package builds none)
        positions = torch.arange(seq_len, device=x.device).unsqueeze(0).expand(batch_size, -1)
        q = self.rope(q, positions)
        k = self.rope(k, positions)
        # causal mask from a float [s, s] ones tensor: triu, to bool, invert (the package:
        # one comparison of two aranges)
        mask = torch.triu(torch.ones(seq_len, seq_len, device=x.device), diagonal=1).to(torch.bool)
        mask = ~mask
        mask = mask.unsqueeze(0).unsqueeze(0).expand(batch_size, self.num_heads, -1, -1)
        result = student_attention(q, k, v, mask)
        result = rearrange(result, "b h s d -> b s (h d)")
        result = self.output_proj(result)
        return result


class StudentSwiGLU(nn.Module):
    # the package: w2(silu(w1 x) * w3 x), w3 after the silu.  The student: w1 x, then w3 x,
    # then sigmoid(t1) * t1, then the product: five [b, s, d_ff] tensors, all kept.
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = StudentLinear(d_model, d_ff)
        self.w2 = StudentLinear(d_ff, d_model)
        self.w3 = StudentLinear(d_model, d_ff)

    def forward(self, x):
        t1 = self.w1(x)
        t3 = self.w3(x)
        t2 = torch.sigmoid(t1) * t1
        return self.w2(t2 * t3)


class StudentBlock(nn.Module):
    # registration order ln1, attn, ln2, ffn (the package: attn, ffn, ln1, ln2) decides the
    # optimizer's parameter order, so the order its lazily created states are allocated in
    def __init__(self, d_model: int, num_heads: int, d_ff: int, max_seq_len: int, theta: float):
        super().__init__()
        self.ln1 = StudentRMSNorm(d_model)
        self.attn = StudentAttention(d_model, num_heads, max_seq_len, theta)
        self.ln2 = StudentRMSNorm(d_model)
        self.ffn = StudentSwiGLU(d_model, d_ff)

    def forward(self, x):
        h = self.ln1(x)
        h = self.attn(h)
        x = x + h
        h = self.ln2(x)
        h = self.ffn(h)  # held by h until the block returns
        x = x + h
        return x


class StudentTransformerLM(nn.Module):
    def __init__(self, vocab_size: int, context_length: int, d_model: int, num_layers: int,
                 num_heads: int, d_ff: int, theta: float = ROPE_THETA):
        super().__init__()
        # the student's embedding is randn-initialised (the package: truncated normal); the
        # lookup is the same single gather
        self.token_embeddings = Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList(
            StudentBlock(d_model, num_heads, d_ff, context_length, theta) for _ in range(num_layers))
        self.ln_final = StudentRMSNorm(d_model)
        self.lm_head = StudentLinear(d_model, vocab_size)

    def forward(self, token_ids):
        x = self.token_embeddings(token_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_final(x))


def student_cross_entropy(logits, targets):
    # the package: -log_softmax then gather.  The student: max over the vocabulary (values and
    # int64 indices), shifted logits, exp, sum, the target logits picked by advanced indexing
    # with a CPU arange (copied to the device inside the indexing), log(sum) - picked, mean.
    # The shifted logits and their exp are full [b*s, vocab] tensors kept for backward.
    vocab_size = logits.shape[-1]
    logits = logits.reshape(-1, vocab_size)
    targets = targets.reshape(-1)
    maxes = torch.max(logits, dim=-1, keepdim=True)[0]
    shifted = logits - maxes
    sum_exp = torch.exp(shifted).sum(dim=-1)
    picked = shifted[torch.arange(logits.shape[0]), targets]
    losses = torch.log(sum_exp) - picked
    return losses.mean()


class StudentAdamW(AdamW):
    """The student's AdamW; only the constructor is the package's.

    The package's step, run every step: two zeros_like temporaries per parameter (the
    ``state.get`` defaults are built even when the state exists), new m and v tensors replacing
    the old ones, and about a dozen parameter-sized temporaries.  The student's: the moments
    are created lazily, on the first step, inside ``step`` (two zeros_like per parameter, kept);
    they are then updated in place, as are the weights; the only temporaries are
    ``sqrt(v)`` (freed at once) and the denominator, which lives until the next parameter's
    replaces it (and the last one until ``step`` returns).  Weight decay is applied after the
    update, in place."""

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr = group["lr"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.data
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p.data)
                    state["exp_avg_sq"] = torch.zeros_like(p.data)
                state["step"] += 1
                step = state["step"]
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(group["eps"])
                p.data.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))
                if group["weight_decay"] != 0:
                    p.data.add_(p.data, alpha=-lr * group["weight_decay"])
        return loss


def run_memory_forward_fullstep(model, optimizer, device, batch_size: int, context_length: int,
                                vocab_size: int, snapshot_path: str, forward_only: bool) -> None:
    """run_memory_foward_fullstep: the first step of a fresh process, no warm-up."""
    # token ids made on the CPU and copied over, before recording; targets are the inputs
    batch = torch.randint(low=0, high=vocab_size, size=(batch_size, context_length)).to(device)
    inputs = targets = batch
    on_cuda = torch.cuda.is_available()
    # recording starts before the cache is emptied, as in the original
    if on_cuda:
        torch.cuda.memory._record_memory_history(max_entries=1000000)
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
    if forward_only:
        # grad mode stays on: the activations saved for a backward are alive at the dump
        logits = model(inputs)  # noqa: F841
    else:
        optimizer.zero_grad()  # torch's own (the grads are still None here)
        logits = model(inputs)
        loss = student_cross_entropy(logits, targets)
        loss.backward()
        optimizer.step()
    if on_cuda:
        torch.cuda.synchronize()
        peak_mib = torch.cuda.max_memory_allocated(device) / (1024**2)
        print(f"Peak memory allocated: {peak_mib:.2f} MiB")
        torch.cuda.memory._dump_snapshot(snapshot_path)
        torch.cuda.memory._record_memory_history(enabled=None)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context-length", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=CONFIG_2_7B["d_model"])
    parser.add_argument("--num-layers", type=int, default=CONFIG_2_7B["num_layers"])
    parser.add_argument("--d-ff", type=int, default=CONFIG_2_7B["d_ff"])
    parser.add_argument("--num-heads", type=int, default=CONFIG_2_7B["num_heads"])
    parser.add_argument("--vocab-size", type=int, default=CONFIG_2_7B["vocab_size"])
    parser.add_argument("--forward-only", action="store_true",
                        help="record the forward only (run_memory_foward_fullstep's forward_only branch)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the model (the forward snapshot's run was compiled; see README)")
    parser.add_argument("--snapshot", default=None,
                        help="where a CUDA run dumps its snapshot "
                             "(default: memory_ctx<ctx>_{fullstep,forward}.pickle)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_float32_matmul_precision("high")  # fp32 weights, TF32 matmuls on the GPU
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # the student's modules take device= and create their parameters on the GPU directly
    with device:
        model = StudentTransformerLM(
            vocab_size=args.vocab_size, context_length=args.context_length, d_model=args.d_model,
            num_layers=args.num_layers, num_heads=args.num_heads, d_ff=args.d_ff)
    model.to(device)
    if args.compile:
        model = torch.compile(model)
    optimizer = StudentAdamW(model.parameters(), lr=1e-4, weight_decay=0.01, eps=1e-8, betas=(0.9, 0.95))
    kind = "forward" if args.forward_only else "fullstep"
    run_memory_forward_fullstep(
        model, optimizer, device, batch_size=BATCH_SIZE, context_length=args.context_length,
        vocab_size=args.vocab_size, forward_only=args.forward_only,
        snapshot_path=args.snapshot or f"memory_ctx{args.context_length}_{kind}.pickle")


if __name__ == "__main__":
    main()
