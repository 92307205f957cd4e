"""apply stops what the script's own code cannot run correctly under the plan, naming the
line, before any optimizer step (``apply/batch_watch.py``): a loss coupling the batch's
samples on a plan that splits the batch, and an op refusing mixed dtypes under a 16-bit
plan.  A script that gathers the other ranks' embeddings runs."""
import os
import subprocess
import sys

import pytest

from apply_runs import REPO

CONTRASTIVE = '''
import argparse
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--gather", action="store_true")
p.add_argument("--two-views", action="store_true")
args = p.parse_args()
torch.manual_seed(0)


class Towers(nn.Module):
    def __init__(self):
        super().__init__()
        self.images, self.texts = nn.Linear(12, 8), nn.Linear(10, 8)

    def forward(self, x, y):
        return F.normalize(self.images(x), dim=-1), F.normalize(self.texts(y), dim=-1)


def gathered(features):
    """open_clip's gather_features: the other ranks' features, ours with its gradient."""
    if not (args.gather and dist.is_initialized()):
        return features
    parts = [torch.zeros_like(features) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, features.detach())
    parts[dist.get_rank()] = features
    return torch.cat(parts)


def contrastive(a, b):
    if args.two_views:
        z = torch.cat([a, b])
        logits = z @ z.T
        labels = torch.arange(z.shape[0]).roll(z.shape[0] // 2)
    else:
        logits = a @ gathered(b).T
        offset = dist.get_rank() * a.shape[0] if args.gather and dist.is_initialized() else 0
        labels = torch.arange(a.shape[0]) + offset
    return F.cross_entropy(logits, labels)


model = Towers()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(2):
    x, y = torch.randn(8, 12), torch.randn(8, 10)
    optimizer.zero_grad()
    a, b = model(x, y)
    loss = contrastive(a, b)
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item():.4f}")
'''

SCATTER = '''
import torch
from torch import nn


class Messages(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x, edges):
        h = self.lin(x)
        deg = torch.zeros(x.shape[0]).index_add_(0, edges[1], torch.ones(edges.shape[1]))
        msg = h[edges[0]] / deg[edges[1]].unsqueeze(-1)
        return torch.zeros_like(h).index_add_(0, edges[1], msg)


torch.manual_seed(0)
model = Messages()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(2):
    x, edges = torch.randn(5, 6), torch.randint(0, 5, (2, 12))
    optimizer.zero_grad()
    loss = model(x, edges).pow(2).mean()
    loss.backward()
    optimizer.step()
'''


def apply(tmp_path, source, *args):
    script = tmp_path / "train.py"
    script.write_text(source)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "memadvisor.cli", "apply", str(script), "-q",
                           *map(str, args)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)


def test_accumulation_on_in_batch_negatives_is_refused_naming_the_line(tmp_path):
    run = apply(tmp_path, CONTRASTIVE, "--plan", "accum=2")
    assert run.returncode == 2, run.stderr
    assert "the loss couples the samples of a batch: train_memadvisor.py:" in run.stderr
    assert "`logits = a @ gathered(b).T` makes a (4, 4) tensor" in run.stderr
    assert "sees 4 of the script's 8 samples" in run.stderr
    assert "step 0" not in run.stdout  # stopped before any optimizer step


def test_one_tensor_with_itself_is_refused_too(tmp_path):
    run = apply(tmp_path, CONTRASTIVE, "--plan", "accum=4", "--", "--two-views")
    assert run.returncode == 2, run.stderr
    assert "`logits = z @ z.T` makes a (4, 4) tensor" in run.stderr


def test_the_override_runs_the_changed_loss(tmp_path):
    run = apply(tmp_path, CONTRASTIVE, "--plan", "accum=2", "--allow-batch-coupling")
    assert run.returncode == 0, run.stderr
    assert "step 1 loss" in run.stdout


@pytest.mark.slow
def test_data_parallel_is_refused_unless_the_script_gathers(tmp_path):
    run = apply(tmp_path, CONTRASTIVE, "--plan", "shard=ddp,world=2", "--nproc", "2")
    assert run.returncode != 0
    assert "makes a (4, 4) tensor" in run.stderr and "under shard=ddp" in run.stderr
    # (4, 8): each rank's samples against the whole batch's, as the unmodified script
    gathered = apply(tmp_path, CONTRASTIVE, "--plan", "shard=ddp,world=2", "--nproc", "2",
                     "--", "--gather")
    assert gathered.returncode == 0, gathered.stderr
    # gathering over 2 ranks does not make up for 2 micro-batches per rank: (2, 4) of 8
    both = apply(tmp_path, CONTRASTIVE, "--plan", "accum=2,shard=ddp,world=2", "--nproc", "2",
                 "--", "--gather")
    assert both.returncode != 0 and "makes a (2, 4) tensor" in both.stderr


@pytest.mark.parametrize("precision, line, written", [
    ("amp-bf16", "return torch.zeros_like(h).index_add_(0, edges[1], msg)",
     "a float32 source into a bfloat16 tensor"),
    ("bf16", "return torch.zeros_like(h).index_add_(0, edges[1], msg)",
     "a float32 source into a bfloat16 tensor")])
def test_a_16_bit_plan_on_an_op_refusing_mixed_dtypes_is_refused(tmp_path, precision, line,
                                                                  written):
    run = apply(tmp_path, SCATTER, "--plan", f"precision={precision}")
    assert run.returncode == 2, run.stderr
    assert f"precision={precision}: train_memadvisor.py:" in run.stderr
    assert f"`{line}`: index_add_ writes {written}" in run.stderr
    assert "Traceback" not in run.stderr


def test_matching_dtypes_run(tmp_path):
    fixed = SCATTER.replace("torch.zeros_like(h).index_add_(0, edges[1], msg)",
                            "torch.zeros_like(h).index_add_(0, edges[1], msg.to(h.dtype))")
    run = apply(tmp_path, fixed, "--plan", "precision=amp-bf16")
    assert run.returncode == 0, run.stderr


def test_the_watch_stops_advanced_indexing_only(tmp_path):
    """``x[idx] = v`` with a tensor index is index_put_ (refuses), with a slice a cast copy."""
    import torch

    from memadvisor.apply.batch_watch import DtypeWatch
    from memadvisor.plan import PlanError
    buffer, values = torch.zeros(4), torch.ones(2, dtype=torch.bfloat16)
    with DtypeWatch("amp-bf16"):
        buffer[0:2] = values
        buffer[torch.tensor(1)] = values[0]
    with pytest.raises(PlanError, match="__setitem__ writes a bfloat16 source into a float32"):
        with DtypeWatch("amp-bf16"):
            buffer[torch.tensor([0, 1])] = values


def test_one_value_filled_by_index_put_is_cast_not_stopped():
    import torch

    from memadvisor.apply.batch_watch import DtypeWatch
    buffer, mask = torch.zeros(4), torch.tensor([True, False, True, False])
    with DtypeWatch("bf16"):
        buffer[mask] = torch.ones(1, dtype=torch.bfloat16)  # torch casts one value
        buffer.index_put_((mask,), torch.tensor(2.0, dtype=torch.bfloat16))
    assert buffer.tolist() == [2.0, 0.0, 2.0, 0.0]


EMA = '''
import copy
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 1))
ema = copy.deepcopy(model).requires_grad_(False)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(2):
    x, y = torch.randn(8, 6), torch.randn(8, 1)
    optimizer.zero_grad()
    loss = (model(x) - y).pow(2).mean()
    loss.backward()
    optimizer.step()
    for ema_p, p in zip(ema.parameters(), model.parameters()):
        ema_p.lerp_(p, 0.01)
'''


def test_an_fp32_ema_lerped_towards_bf16_parameters_is_stopped_after_the_step(tmp_path):
    run = apply(tmp_path, EMA, "--plan", "precision=bf16")
    assert run.returncode == 2, run.stderr
    assert ("`ema_p.lerp_(p, 0.01)`: lerp_ writes a bfloat16 source into a float32 tensor"
            in run.stderr)
    assert apply(tmp_path, EMA, "--plan", "precision=amp-bf16").returncode == 0


def test_the_watches_leave_in_any_order():
    from torch.overrides import _get_current_function_mode_stack

    from memadvisor.apply.batch_watch import CouplingWatch, DtypeWatch, _leave
    before = len(_get_current_function_mode_stack())
    coupling, dtypes = CouplingWatch([], 2, 4, "accum=2"), DtypeWatch("amp-bf16")
    coupling.__enter__()
    dtypes.__enter__()
    _leave(coupling)  # the first backward, the dtype watch still on
    assert _get_current_function_mode_stack()[-1] is dtypes
    _leave(dtypes)
    _leave(dtypes)  # twice: nothing
    assert len(_get_current_function_mode_stack()) == before
