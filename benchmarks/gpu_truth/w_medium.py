"""The writer of the W_medium_{128,512,1024}_training snapshots, reproduced.

    python benchmarks/gpu_truth/w_medium.py --context-length 128 [--snapshot PATH]
    python benchmarks/gpu_truth/w_medium.py --context-length 512 --autocast   # and 1024
    python benchmarks/gpu_truth/w_medium.py --d-model 64 --num-layers 2 --d-ff 128 \
        --num-heads 4 --vocab-size 100 --context-length 16        # tiny, on CPU

Original: github Wedsonlin/assignment2-systems, ``nsys_profile.py`` at commit 8630bcf,
``memory_profile(pattern="full-training-step")``, run as ``--memory-profile true --pattern
full-training-step`` with the "medium" config (MIT licence, Copyright 2025 Stanford
University: ``cs336_basics/LICENSE``).  The model package ``cs336_basics/`` beside this file
is the original's, byte for byte.  What differs from the original is listed in README.md.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

# the package's modules import each other as ``cs336_basics.*``; a runner that does not put
# this folder first on sys.path (as ``python w_medium.py`` does) still finds them
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from cs336_basics.model import BasicsTransformerLM  # noqa: E402
from cs336_basics.nn_utils import cross_entropy  # noqa: E402
from cs336_basics.optimizer import AdamW  # noqa: E402

# scripts/run_profile_configs.sh, "medium"; vocab and RoPE theta are nsys_profile.py's and
# BasicsTransformerLM's defaults
MEDIUM_CONFIG = dict(d_model=1024, d_ff=4096, num_layers=24, num_heads=16, vocab_size=10_000)
BATCH_SIZE = 4  # hard-coded in memory_profile


def memory_profile_full_training_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    snapshot_path: str,
    warmup_steps: int = 5,
    autocast: bool = False,
) -> None:
    """memory_profile(pattern="full-training-step"), statement for statement.

    Every batch is made up front on the target device, outside the recorded region: the
    token ids of all warm-up steps and of the recorded step stay alive through it."""
    execution_steps = 1
    batch_size = BATCH_SIZE
    warmup_inputs = torch.randint(
        low=0,
        high=model.config["vocab_size"],
        size=(warmup_steps, batch_size, model.config["context_length"]),
        dtype=torch.long,
        device=device,
    )
    execution_inputs = torch.randint(
        low=0,
        high=model.config["vocab_size"],
        size=(execution_steps, batch_size, model.config["context_length"]),
        dtype=torch.long,
        device=device,
    )
    warmup_targets = torch.randint(
        low=0,
        high=model.config["vocab_size"],
        size=(warmup_steps, batch_size, model.config["context_length"]),
        dtype=torch.long,
        device=device,
    )
    execution_targets = torch.randint(
        low=0,
        high=model.config["vocab_size"],
        size=(execution_steps, batch_size, model.config["context_length"]),
        dtype=torch.long,
        device=device,
    )

    model.train()
    for i in range(warmup_steps):
        # device_type is "cuda" even on a CPU run, as in the original; disabled, it does nothing
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=autocast):
            output = model(warmup_inputs[i])
            loss = cross_entropy(output, warmup_targets[i])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()  # set_to_none=True is the default since torch 2.0
    if torch.cuda.is_available():
        torch.cuda.synchronize()

    # the last warm-up step's logits and loss are dropped before recording
    del output, loss
    optimizer.zero_grad(set_to_none=True)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(max_entries=1000000)

    with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=autocast):
        output = model(execution_inputs[0])
        loss = cross_entropy(output, execution_targets[0])
    loss.backward()
    optimizer.step()
    # no zero_grad after the recorded step: the gradients are alive in the dump
    if torch.cuda.is_available():
        torch.cuda.synchronize()

    if torch.cuda.is_available():
        peak_memory = torch.cuda.max_memory_allocated()
        print(f"Peak memory allocated: {peak_memory / 1024 / 1024} MB")
        torch.cuda.memory._dump_snapshot(snapshot_path)
        torch.cuda.memory._record_memory_history(enabled=None)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context-length", type=int, default=512,
                        help="tokens per sequence (the snapshots: 128, 512, 1024)")
    parser.add_argument("--d-model", type=int, default=MEDIUM_CONFIG["d_model"])
    parser.add_argument("--num-layers", type=int, default=MEDIUM_CONFIG["num_layers"])
    parser.add_argument("--d-ff", type=int, default=MEDIUM_CONFIG["d_ff"])
    parser.add_argument("--num-heads", type=int, default=MEDIUM_CONFIG["num_heads"])
    parser.add_argument("--vocab-size", type=int, default=MEDIUM_CONFIG["vocab_size"])
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--autocast", action="store_true",
                        help="bf16 autocast: the ctx 512 and 1024 snapshots were recorded with it "
                             "(their forward casts every Linear's input and weight), ctx 128 without")
    parser.add_argument("--snapshot", default=None,
                        help="where a CUDA run dumps its snapshot "
                             "(default: medium_<ctx>_training_memory_snapshot.pickle)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # built on the CPU, then moved: the original's order (the parameters' CPU init never
    # touches the GPU allocator)
    model = BasicsTransformerLM(
        vocab_size=args.vocab_size,
        context_length=args.context_length,
        d_model=args.d_model,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        d_ff=args.d_ff,
    )
    model.to(device)
    optimizer = AdamW(model.parameters())  # the package's defaults: lr 1e-3, betas (0.9, 0.999)
    snapshot_path = args.snapshot or f"medium_{args.context_length}_training_memory_snapshot.pickle"
    memory_profile_full_training_step(
        model=model,
        optimizer=optimizer,
        device=device,
        snapshot_path=snapshot_path,
        warmup_steps=args.warmup_steps,
        autocast=args.autocast,
    )


if __name__ == "__main__":
    main()
