"""Tiny framework scripts for the tests, written in the styles of the zoo (built in code,
CPU, seconds): each prints ``final_loss=`` and runs 3 optimizer steps of a batch of 8."""

HF_TRAINER = '''
import tempfile
import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Blocks(Dataset):
    def __init__(self, n):
        self.ids = torch.randint(0, 64, (n, 8), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def main():
    config = GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, per_device_train_batch_size=8, max_steps=3,
                                 learning_rate=1e-3, save_strategy="no", report_to=[],
                                 use_cpu=True, disable_tqdm=True, logging_steps=1)
        result = Trainer(model=model, args=args, train_dataset=Blocks(24)).train()
    print(f"final_loss={result.training_loss:.6f}")


if __name__ == "__main__":
    main()
'''

LIGHTNING = '''
import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class Lit(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
                                    for _ in range(2))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.last_loss = loss.item()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(24, 8, generator=g), torch.randint(0, 2, (24,), generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=8)


def main():
    L.seed_everything(0, verbose=False)
    model = Lit()
    trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model)
    print(f"final_loss={model.last_loss:.6f}")


if __name__ == "__main__":
    main()
'''

ACCELERATE = '''
import torch
import torch.nn as nn
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset


def main():
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(24, 8, generator=g), torch.randn(24, generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=len(loader))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for inputs, targets in loader:
        loss = nn.functional.mse_loss(model(inputs).squeeze(-1), targets)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    print(f"final_loss={loss.item():.6f}")


if __name__ == "__main__":
    main()
'''
