"""A batch collated from samples of different sizes (graphs joined into one, PyG-style):
the dimension read as the batch counts nodes and changes every step.  Said in the warnings;
simulate refuses plans that split it (they would cut graphs apart, which apply cannot do),
advise proposes none (``simulate/ragged_batch.py``).  A fixed batch is not flagged."""
import pytest
import torch
import torch.nn as nn

from memadvisor.plan import Plan, PlanError
from memadvisor.simulate import advise, prepare, simulate
from memadvisor.simulate.hardware import hardware

GRAPHS = 8


class GraphNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(6, 6), nn.Linear(6, 2)

    def forward(self, x, edges, batch):
        h = torch.relu(self.lin(x))
        h = torch.zeros_like(h).index_add(0, edges[1], h[edges[0]])
        return self.head(torch.zeros(GRAPHS, 6).index_add(0, batch, h))


def _graph_batches(nodes_per_step, steps: int = 3):
    import loops
    torch.manual_seed(0)
    model = GraphNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sizes = iter(nodes_per_step)

    def step():
        nodes = next(sizes)
        x = torch.randn(nodes, 6)
        edges = torch.randint(0, nodes, (2, 3 * nodes))  # global node ids
        batch = torch.arange(nodes) % GRAPHS  # node -> graph
        y = torch.randint(0, 2, (GRAPHS,))
        loss = nn.functional.cross_entropy(model(x, edges, batch), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    return loops.profile_steps(step, steps)


def test_a_batch_of_concatenated_graphs_is_said_and_not_split(loops):
    base = prepare(_graph_batches([50, 46, 58, 52]))
    assert base.ragged_batch and "(50, 46, 58)" in base.ragged_batch
    assert any("counts nodes or tokens, not samples" in w for w in base.warnings)
    cpu = hardware(None, "cpu")
    with pytest.raises(PlanError, match="has a different size in every step"):
        simulate(base, Plan.parse("accum=2"), cpu)
    assert simulate(base, Plan.parse("precision=fp32"), cpu).peak_bytes > 0
    result = advise(base, cpu, 1 << 30, 2, top=100)
    assert result.ranked and all(p.plan.accum == 1 and p.plan.world == 1
                                 for p in result.ranked)
    assert not result.max_micro_batch  # nodes are not samples: nothing extrapolated


def test_a_fixed_batch_is_not_flagged(loops):
    assert prepare(_graph_batches([48, 48, 48, 48])).ragged_batch is None
