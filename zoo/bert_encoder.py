"""A BERT-style encoder trained with masked-language modelling: hand-written multi-head
attention whose scores are ``masked_fill``-ed at padding positions before the softmax,
post-norm blocks with GELU, learned position and token-type embeddings, variable-length
sequences padded to the longest in the batch, and labels of -100 outside masked tokens.

Imitates the style of the original BERT / "annotated transformer" PyTorch ports (written
here from scratch; random token sequences).

    python zoo/bert_encoder.py
"""
# zoo: {"batch_size": 8, "batch_layout": "batch-first", "steps_per_iteration": 1,
#   "optimizers": 1, "framework": "raw", "iterations": 3, "exact_split": false,
#   "split_note": "the loss is a mean over masked tokens, whose count differs per micro-batch",
#   "plans": ["amp-bf16", "checkpoint", "accum", "ddp", "zero2", "zero3"]}
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

PAD, CLS, SEP, MASK = 0, 1, 2, 3


class BertConfig:
    def __init__(self, vocab_size=100, hidden_size=48, num_hidden_layers=2,
                 num_attention_heads=4, intermediate_size=96, max_position_embeddings=40,
                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.hidden_dropout_prob = hidden_dropout_prob
        self.attention_probs_dropout_prob = attention_probs_dropout_prob


class SelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_size = config.hidden_size // config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def split_heads(self, x):
        b, t, _ = x.size()
        return x.view(b, t, self.num_heads, self.head_size).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask):
        q = self.split_heads(self.query(hidden_states))
        k = self.split_heads(self.key(hidden_states))
        v = self.split_heads(self.value(hidden_states))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_size)
        # attention_mask: (batch, seq) with 1 for real tokens and 0 for padding
        scores = scores.masked_fill(attention_mask[:, None, None, :] == 0, -1e4)
        probs = self.dropout(F.softmax(scores, dim=-1))
        context = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous()
        return context.view(context.size(0), context.size(1), -1)


class BertLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = SelfAttention(config)
        self.attention_output = nn.Linear(config.hidden_size, config.hidden_size)
        self.attention_norm = nn.LayerNorm(config.hidden_size, eps=1e-12)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, config.hidden_size)
        self.output_norm = nn.LayerNorm(config.hidden_size, eps=1e-12)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, attention_mask):
        attn = self.dropout(self.attention_output(self.attention(hidden_states, attention_mask)))
        hidden_states = self.attention_norm(hidden_states + attn)
        ffn = self.dropout(self.output(F.gelu(self.intermediate(hidden_states))))
        return self.output_norm(hidden_states + ffn)


class BertForMaskedLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=PAD)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(2, config.hidden_size)
        self.embeddings_norm = nn.LayerNorm(config.hidden_size, eps=1e-12)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))
        self.transform = nn.Linear(config.hidden_size, config.hidden_size)
        self.transform_norm = nn.LayerNorm(config.hidden_size, eps=1e-12)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)
        self.decoder.weight = self.word_embeddings.weight

    def forward(self, input_ids, attention_mask, token_type_ids):
        positions = torch.arange(input_ids.size(1), device=input_ids.device)[None, :]
        h = (self.word_embeddings(input_ids) + self.position_embeddings(positions)
             + self.token_type_embeddings(token_type_ids))
        h = self.embeddings_norm(h)
        for layer in self.layers:
            h = layer(h, attention_mask)
        h = self.transform_norm(F.gelu(self.transform(h)))
        return self.decoder(h)


def make_batch(batch_size, max_len, vocab_size, generator):
    lengths = torch.randint(max_len // 2, max_len + 1, (batch_size,), generator=generator)
    input_ids = torch.full((batch_size, max_len), PAD, dtype=torch.long)
    for row, length in enumerate(lengths.tolist()):
        body = torch.randint(4, vocab_size, (length - 2,), generator=generator)
        input_ids[row, :length] = torch.cat([torch.tensor([CLS]), body, torch.tensor([SEP])])
    attention_mask = (input_ids != PAD).long()
    labels = torch.full_like(input_ids, -100)
    chosen = (torch.rand(input_ids.shape, generator=generator) < 0.15) & (input_ids > SEP)
    labels[chosen] = input_ids[chosen]
    input_ids = input_ids.masked_fill(chosen, MASK)
    token_type_ids = torch.zeros_like(input_ids)
    return input_ids, attention_mask, token_type_ids, labels


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = BertConfig()
    model = BertForMaskedLM(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    generator = torch.Generator().manual_seed(args.seed)

    model.train()
    for step in range(args.steps):
        input_ids, attention_mask, token_type_ids, labels = make_batch(
            args.batch_size, args.max_len, config.vocab_size, generator)
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        token_type_ids, labels = token_type_ids.to(device), labels.to(device)
        logits = model(input_ids, attention_mask, token_type_ids)
        loss = F.cross_entropy(logits.view(-1, config.vocab_size), labels.view(-1),
                               ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"iter {step} mlm loss {loss.item():.4f}")
    print(f"final_loss={loss.item():.6f}")


if __name__ == "__main__":
    main()
