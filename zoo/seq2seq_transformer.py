"""A sequence-to-sequence ``nn.Transformer`` in its default sequence-first layout
(``(seq, batch)`` tensors everywhere): token embeddings scaled by sqrt(d_model), a sinusoidal
``PositionalEncoding`` buffer, a square subsequent mask for the decoder and key padding
masks for source and target, trained with teacher forcing to reverse digit strings.

Imitates the style of the PyTorch tutorial "Language Translation with nn.Transformer"
(written here from scratch; synthetic source/target pairs instead of Multi30k).

    python zoo/seq2seq_transformer.py
"""
# zoo: {"batch_size": 8, "batch_layout": "seq-first", "steps_per_iteration": 1,
#   "optimizers": 1, "framework": "raw", "iterations": 3, "exact_split": false,
#   "split_note": "the loss is a mean over non-padding target tokens, whose count differs per micro-batch",
#   "plans": ["amp-bf16", "checkpoint", "accum", "ddp", "zero2", "zero3"]}
import argparse
import math

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

PAD_IDX, BOS_IDX, EOS_IDX = 0, 1, 2
VOCAB = 16
DEVICE = torch.device('cuda' if torch.cuda.is_available() else 'cpu')


class PositionalEncoding(nn.Module):
    def __init__(self, emb_size: int, dropout: float, maxlen: int = 64):
        super().__init__()
        den = torch.exp(- torch.arange(0, emb_size, 2) * math.log(10000) / emb_size)
        pos = torch.arange(0, maxlen).reshape(maxlen, 1)
        pos_embedding = torch.zeros((maxlen, emb_size))
        pos_embedding[:, 0::2] = torch.sin(pos * den)
        pos_embedding[:, 1::2] = torch.cos(pos * den)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer('pos_embedding', pos_embedding.unsqueeze(-2))

    def forward(self, token_embedding: Tensor):
        return self.dropout(token_embedding + self.pos_embedding[:token_embedding.size(0), :])


class TokenEmbedding(nn.Module):
    def __init__(self, vocab_size: int, emb_size):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, emb_size)
        self.emb_size = emb_size

    def forward(self, tokens: Tensor):
        return self.embedding(tokens.long()) * math.sqrt(self.emb_size)


class Seq2SeqTransformer(nn.Module):
    def __init__(self, num_encoder_layers, num_decoder_layers, emb_size, nhead, vocab_size,
                 dim_feedforward=64, dropout=0.0):
        super().__init__()
        self.transformer = nn.Transformer(d_model=emb_size, nhead=nhead,
                                          num_encoder_layers=num_encoder_layers,
                                          num_decoder_layers=num_decoder_layers,
                                          dim_feedforward=dim_feedforward, dropout=dropout)
        self.generator = nn.Linear(emb_size, vocab_size)
        self.src_tok_emb = TokenEmbedding(vocab_size, emb_size)
        self.tgt_tok_emb = TokenEmbedding(vocab_size, emb_size)
        self.positional_encoding = PositionalEncoding(emb_size, dropout=dropout)

    def forward(self, src, trg, src_mask, tgt_mask, src_padding_mask, tgt_padding_mask,
                memory_key_padding_mask):
        src_emb = self.positional_encoding(self.src_tok_emb(src))
        tgt_emb = self.positional_encoding(self.tgt_tok_emb(trg))
        outs = self.transformer(src_emb, tgt_emb, src_mask, tgt_mask, None,
                                src_padding_mask, tgt_padding_mask, memory_key_padding_mask)
        return self.generator(outs)


def generate_square_subsequent_mask(sz):
    mask = (torch.triu(torch.ones((sz, sz), device=DEVICE)) == 1).transpose(0, 1)
    return mask.float().masked_fill(mask == 0, float('-inf')).masked_fill(mask == 1, float(0.0))


def create_mask(src, tgt):
    src_seq_len, tgt_seq_len = src.shape[0], tgt.shape[0]
    tgt_mask = generate_square_subsequent_mask(tgt_seq_len)
    src_mask = torch.zeros((src_seq_len, src_seq_len), device=DEVICE).type(torch.bool)
    src_padding_mask = (src == PAD_IDX).transpose(0, 1)
    tgt_padding_mask = (tgt == PAD_IDX).transpose(0, 1)
    return src_mask, tgt_mask, src_padding_mask, tgt_padding_mask


def collate_fn(pairs):
    src_batch = pad_sequence([s for s, _ in pairs], padding_value=PAD_IDX)
    tgt_batch = pad_sequence([t for _, t in pairs], padding_value=PAD_IDX)
    return src_batch, tgt_batch


def reverse_pairs(n, generator):
    pairs = []
    for _ in range(n):
        length = int(torch.randint(4, 12, (1,), generator=generator))
        digits = torch.randint(3, VOCAB, (length,), generator=generator)
        src = torch.cat([torch.tensor([BOS_IDX]), digits, torch.tensor([EOS_IDX])])
        tgt = torch.cat([torch.tensor([BOS_IDX]), digits.flip(0), torch.tensor([EOS_IDX])])
        pairs.append((src, tgt))
    return pairs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-batches", type=int, default=3)
    parser.add_argument("--emb-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    transformer = Seq2SeqTransformer(2, 2, args.emb_size, 4, VOCAB)
    for p in transformer.parameters():
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)
    transformer = transformer.to(DEVICE)
    loss_fn = torch.nn.CrossEntropyLoss(ignore_index=PAD_IDX)
    optimizer = torch.optim.Adam(transformer.parameters(), lr=0.0001, betas=(0.9, 0.98), eps=1e-9)
    generator = torch.Generator().manual_seed(args.seed)

    transformer.train()
    for it in range(args.num_batches):
        src, tgt = collate_fn(reverse_pairs(args.batch_size, generator))
        src = src.to(DEVICE)
        tgt = tgt.to(DEVICE)
        tgt_input = tgt[:-1, :]
        src_mask, tgt_mask, src_padding_mask, tgt_padding_mask = create_mask(src, tgt_input)
        logits = transformer(src, tgt_input, src_mask, tgt_mask, src_padding_mask,
                             tgt_padding_mask, src_padding_mask)
        optimizer.zero_grad()
        tgt_out = tgt[1:, :]
        loss = loss_fn(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1))
        loss.backward()
        optimizer.step()
        print(f"iter {it} loss {loss.item():.4f} src {tuple(src.shape)}")
    print(f"final_loss={loss.item():.6f}")


if __name__ == "__main__":
    main()
