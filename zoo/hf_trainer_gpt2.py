"""Causal language modelling with the Hugging Face ``Trainer``: a tiny ``GPT2Config`` built
in code (no download), ``GPT2LMHeadModel`` trained from scratch on a dataset of dicts
(``input_ids``, ``attention_mask``, ``labels``), ``TrainingArguments`` with
``per_device_train_batch_size``, ``max_steps``, a linear LR schedule with warmup,
``logging_steps=1`` and no saving or reporting.

Imitates the style of transformers' ``run_clm.py`` / the "train a language model from
scratch" notebooks (written here from scratch; random token blocks, no tokenizer).

    python zoo/hf_trainer_gpt2.py
"""
# zoo: {"batch_size": 8, "batch_layout": "kwargs", "steps_per_iteration": 1,
#   "optimizers": 1, "framework": "hf-trainer", "iterations": 3, "exact_split": true,
#   "plans": ["amp-bf16", "checkpoint", "accum", "ddp", "zero2", "zero3"]}
import argparse
import tempfile

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


class TokenBlocks(Dataset):
    def __init__(self, n, block_size, vocab_size, seed):
        g = torch.Generator().manual_seed(seed)
        self.blocks = torch.randint(0, vocab_size, (n, block_size), generator=g)

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        ids = self.blocks[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


class PrintLoss(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            print(f"iter {state.global_step - 1} loss {logs['loss']:.4f}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--max_steps", type=int, default=3)
    parser.add_argument("--block_size", type=int, default=32)
    parser.add_argument("--output_dir", default=None)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    config = GPT2Config(vocab_size=128, n_positions=args.block_size, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(config)
    train_dataset = TokenBlocks(args.per_device_train_batch_size * args.max_steps, args.block_size,
                                config.vocab_size, args.seed)

    with tempfile.TemporaryDirectory() as tmp:
        training_args = TrainingArguments(
            output_dir=args.output_dir or tmp,
            per_device_train_batch_size=args.per_device_train_batch_size,
            max_steps=args.max_steps,
            learning_rate=5e-4,
            warmup_steps=1,
            weight_decay=0.01,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            seed=args.seed,
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset,
                          callbacks=[PrintLoss()])
        result = trainer.train()
    print(f"final_loss={result.training_loss:.6f}")


if __name__ == "__main__":
    main()
