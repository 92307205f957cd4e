"""A sequence classifier written like a Hugging Face model without the library: a config
object, ``forward(input_ids=None, attention_mask=None, labels=None)`` returning an output
dataclass whose ``loss`` is computed inside the model, a collate function that builds a
dict batch, and a loop that calls ``model(**batch)`` and reads ``outputs.loss``.

Imitates the style of ``transformers`` model code and its "custom training loop" tutorials
(written here from scratch; random token sequences, label = parity of a marker token).

    python zoo/kwargs_model.py
"""
# zoo: {"batch_size": 8, "batch_layout": "kwargs", "steps_per_iteration": 1,
#   "optimizers": 1, "framework": "raw", "iterations": 3, "exact_split": true,
#   "plans": ["amp-bf16", "checkpoint", "accum", "ddp", "zero2", "zero3"]}
import argparse
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset


@dataclass
class TinyConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 2
    num_labels: int = 2
    max_position_embeddings: int = 32


@dataclass
class SequenceClassifierOutput:
    loss: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None


class TinyEncoderForSequenceClassification(nn.Module):
    def __init__(self, config: TinyConfig):
        super().__init__()
        self.config = config
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        layer = nn.TransformerEncoderLayer(config.hidden_size, config.num_heads,
                                           4 * config.hidden_size, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, config.num_layers, enable_nested_tensor=False)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, input_ids=None, attention_mask=None, labels=None):
        positions = torch.arange(input_ids.size(1), device=input_ids.device)
        hidden = self.embeddings(input_ids) + self.position_embeddings(positions)[None]
        hidden = self.encoder(hidden, src_key_padding_mask=attention_mask == 0)
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1)
        logits = self.classifier(pooled)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.view(-1, self.config.num_labels), labels.view(-1))
        return SequenceClassifierOutput(loss=loss, logits=logits)


class ParityDataset(Dataset):
    def __init__(self, n, max_len, vocab, seed):
        g = torch.Generator().manual_seed(seed)
        self.examples = []
        for _ in range(n):
            length = int(torch.randint(4, max_len + 1, (1,), generator=g))
            ids = torch.randint(2, vocab, (length,), generator=g)
            self.examples.append((ids, int((ids == 7).sum()) % 2))

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]


def collate(examples):
    max_len = max(len(ids) for ids, _ in examples)
    input_ids = torch.zeros(len(examples), max_len, dtype=torch.long)
    attention_mask = torch.zeros(len(examples), max_len, dtype=torch.long)
    for row, (ids, _) in enumerate(examples):
        input_ids[row, :len(ids)] = ids
        attention_mask[row, :len(ids)] = 1
    labels = torch.tensor([label for _, label in examples])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--num_train_epochs", type=int, default=1)
    parser.add_argument("--learning_rate", type=float, default=5e-4)
    parser.add_argument("--seed", type=int, default=13)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    config = TinyConfig()
    model = TinyEncoderForSequenceClassification(config)
    train_dataset = ParityDataset(3 * args.per_device_train_batch_size, config.max_position_embeddings,
                                  config.vocab_size, args.seed)
    train_dataloader = DataLoader(train_dataset, shuffle=True, collate_fn=collate,
                                  batch_size=args.per_device_train_batch_size,
                                  generator=torch.Generator().manual_seed(args.seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model.to(device)

    completed_steps = 0
    for epoch in range(args.num_train_epochs):
        model.train()
        for batch in train_dataloader:
            batch = {k: v.to(device) for k, v in batch.items()}
            outputs = model(**batch)
            loss = outputs.loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            print(f"iter {completed_steps} epoch {epoch} loss {loss.item():.4f}")
            completed_steps += 1
    print(f"final_loss={loss.item():.6f}")


if __name__ == "__main__":
    main()
