"""A ``LightningModule`` text classifier trained by ``lightning.Trainer``: the model's
layers live on the module itself, ``training_step`` computes and logs the loss,
``configure_optimizers`` returns AdamW with a step-wise cosine schedule, data comes from a
``LightningDataModule``, and the Trainer runs a fixed ``max_steps`` with ``accelerator="auto"``
(the GPU when there is one) without checkpointing, logging or progress bars.

Imitates the style of the Lightning documentation's "LightningModule" and "DataModule"
examples (written here from scratch; random token sequences labelled by their mean token).

    python zoo/lightning_classifier.py
"""
# zoo: {"batch_size": 8, "batch_layout": "batch-first", "steps_per_iteration": 1,
#   "optimizers": 1, "framework": "lightning", "iterations": 3, "exact_split": true,
#   "plans": ["amp-bf16", "checkpoint", "accum", "ddp", "zero2", "zero3"]}
import argparse

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class LitClassifier(L.LightningModule):
    def __init__(self, vocab_size=64, dim=32, heads=2, depth=2, num_classes=3, lr=1e-3, max_steps=3):
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.head = nn.Linear(dim, num_classes)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(1))

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        logits = self(tokens)
        loss = F.cross_entropy(logits, labels)
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        print(f"iter {self.global_step - 1} loss {outputs['loss'].item():.4f}")
        self.last_loss = outputs["loss"].item()

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.hparams.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class TokenDataModule(L.LightningDataModule):
    def __init__(self, batch_size=8, n=24, seq_len=16, vocab_size=64, seed=0):
        super().__init__()
        self.batch_size, self.n, self.seq_len, self.vocab_size, self.seed = batch_size, n, seq_len, vocab_size, seed

    def setup(self, stage=None):
        g = torch.Generator().manual_seed(self.seed)
        tokens = torch.randint(0, self.vocab_size, (self.n, self.seq_len), generator=g)
        labels = (tokens.float().mean(1) * 3 / self.vocab_size).long().clamp(max=2)
        self.train_set = TensorDataset(tokens, labels)

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    L.seed_everything(args.seed, verbose=False)
    model = LitClassifier(max_steps=args.max_steps)
    data = TokenDataModule(batch_size=args.batch_size, n=args.batch_size * args.max_steps, seed=args.seed)
    trainer = L.Trainer(max_steps=args.max_steps, accelerator="auto", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, datamodule=data)
    print(f"final_loss={model.last_loss:.6f}")


if __name__ == "__main__":
    main()
