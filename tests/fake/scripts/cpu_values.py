"""Values computed on the CPU before the GPU sees the batch: lengths, a packing, a mask.

Under fake execution on a simulated GPU these small CPU tensors are real, so the shapes
built from them are the ones a real run has; on the CPU target (no GPU: everything on the
CPU) the integer and bool ones are, which are all that shapes are built from here."""
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = torch.nn.Linear(8, 8).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
lengths = torch.tensor([7, 5, 2])
for step in range(2):
    longest = int(lengths.max())  # 7, not a placeholder
    mask = torch.arange(longest)[None, :] < lengths[:, None]
    tokens = torch.randn(3, longest, 8)
    trimmed = torch.ones(int(lengths.sum()) - 2)  # a real shape from real values
    x = tokens.to(device)
    packed = pack_padded_sequence(model(x), lengths, batch_first=True)
    padded, back = pad_packed_sequence(packed, batch_first=True)
    loss = (padded * mask.to(device)[..., None]).sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print("shapes", tuple(packed.data.shape), packed.batch_sizes.tolist(), tuple(padded.shape),
      back.tolist(), tuple(trimmed.shape), int(mask.sum()))
