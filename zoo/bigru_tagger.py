"""A part-of-speech-style sequence tagger: embeddings, a two-layer bidirectional GRU run on
a ``pack_padded_sequence`` of variable-length sentences (``enforce_sorted=False``), unpacked
with ``pad_packed_sequence``, a linear tag classifier, and cross-entropy that ignores the
padding tag.  Sentences come from a ``DataLoader`` whose collate function pads them and
returns their lengths.

Imitates the style of the common PyTorch BiLSTM/BiGRU tagger tutorials (written here from
scratch; a synthetic "language" whose tag is a function of the word and its neighbour).

    python zoo/bigru_tagger.py
"""
# zoo: {"batch_size": 8, "batch_layout": "packed", "steps_per_iteration": 1,
#   "optimizers": 1, "framework": "raw", "iterations": 3, "exact_split": false,
#   "split_note": "the loss is a mean over real (unpadded) tokens, whose count differs per micro-batch",
#   "plans": ["amp-bf16", "accum", "ddp", "zero2", "zero3"]}
import argparse

import torch
import torch.nn as nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence, pad_sequence
from torch.utils.data import DataLoader

PAD_WORD, PAD_TAG = 0, 0
NUM_WORDS, NUM_TAGS = 120, 6


def make_sentences(n, seed):
    g = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(n):
        length = int(torch.randint(3, 20, (1,), generator=g))
        words = torch.randint(1, NUM_WORDS, (length,), generator=g)
        prev = torch.cat([torch.zeros(1, dtype=torch.long), words[:-1]])
        tags = 1 + (words + prev) % (NUM_TAGS - 1)
        data.append((words, tags))
    return data


def collate(batch):
    words = [w for w, _ in batch]
    tags = [t for _, t in batch]
    lengths = torch.tensor([len(w) for w in words])
    return (pad_sequence(words, batch_first=True, padding_value=PAD_WORD),
            pad_sequence(tags, batch_first=True, padding_value=PAD_TAG), lengths)


class BiGRUTagger(nn.Module):
    def __init__(self, vocab_size, tagset_size, embedding_dim=32, hidden_dim=32, num_layers=2):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, embedding_dim, padding_idx=PAD_WORD)
        self.gru = nn.GRU(embedding_dim, hidden_dim, num_layers=num_layers, bidirectional=True,
                          batch_first=True)
        self.hidden2tag = nn.Linear(2 * hidden_dim, tagset_size)

    def forward(self, sentences, lengths):
        embeds = self.word_embeddings(sentences)
        packed = pack_padded_sequence(embeds, lengths.cpu(), batch_first=True, enforce_sorted=False)
        packed_out, _ = self.gru(packed)
        out, _ = pad_packed_sequence(packed_out, batch_first=True, total_length=sentences.size(1))
        return self.hidden2tag(out)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    loader = DataLoader(make_sentences(3 * args.batch_size, args.seed), batch_size=args.batch_size,
                        shuffle=True, collate_fn=collate, generator=torch.Generator().manual_seed(args.seed))
    model = BiGRUTagger(NUM_WORDS, NUM_TAGS).to(device)
    loss_function = nn.CrossEntropyLoss(ignore_index=PAD_TAG)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    iteration = 0
    for epoch in range(args.epochs):
        for sentences, tags, lengths in loader:
            # lengths stay on the CPU: pack_padded_sequence wants them there
            sentences, tags = sentences.to(device), tags.to(device)
            model.zero_grad()
            tag_scores = model(sentences, lengths)
            loss = loss_function(tag_scores.view(-1, NUM_TAGS), tags.view(-1))
            loss.backward()
            optimizer.step()
            print(f"iter {iteration} epoch {epoch} loss {loss.item():.4f} max_len {sentences.size(1)}")
            iteration += 1
    print(f"final_loss={loss.item():.6f}")


if __name__ == "__main__":
    main()
