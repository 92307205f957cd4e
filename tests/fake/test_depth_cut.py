"""fake/depth.py: stacks of alike layers cut where the script makes them, nothing else."""
from __future__ import annotations

import torch.nn as nn

from memadvisor.fake.depth import MIN_LAYERS, cut_stacks


class Block(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.fc = nn.Linear(width, width)


def test_a_stack_of_alike_layers_keeps_the_first_ones_and_is_reported():
    with cut_stacks(3) as stacks:
        blocks = nn.ModuleList([Block() for _ in range(8)])
        seq = nn.Sequential(*[Block() for _ in range(MIN_LAYERS)])
    assert len(blocks) == 3 and len(seq) == 3
    assert [s["layers"] for s in stacks] == [8, MIN_LAYERS]
    assert all(s["layer"] == "Block" for s in stacks)
    assert all(s["source"].endswith(".py:" + s["source"].rsplit(":", 1)[1]) for s in stacks)
    assert __file__ in stacks[0]["source"]
    # outside the context, containers are made whole again
    assert len(nn.ModuleList([Block() for _ in range(8)])) == 8


def test_what_is_not_a_stack_of_alike_layers_is_left_whole():
    shared = Block()
    with cut_stacks(2) as stacks:
        short = nn.ModuleList([Block() for _ in range(MIN_LAYERS - 1)])
        mixed = nn.Sequential(*[Block(8) for _ in range(4)], *[Block(16) for _ in range(4)])
        tied = nn.ModuleList([shared] * 8)  # one layer applied 8 times
        layers = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(),
                               nn.Linear(4, 4), nn.ReLU())
    assert (len(short), len(mixed), len(tied), len(layers)) == (MIN_LAYERS - 1, 8, 8, 6)
    assert stacks == []
