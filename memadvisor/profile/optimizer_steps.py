"""Where a training step ends when the script steps several optimizers per iteration.

What a user calls a step is one iteration of *all* the optimizers (a GAN steps its
discriminator's then its generator's optimizer: one step, not two).  A step therefore ends
at the ``optimizer.step()`` after which every trainable parameter of the profiled models
that some optimizer holds has been stepped since the previous step ended.  The optimizers
are found once, at the first optimizer step, among the live objects (torch keeps no
registry of them); only their parameters that belong to the models the session saw count,
so an optimizer of another model (a leftover, a previous run in the same process) or a
wrapper sharing an optimizer's parameters (Lightning's) changes nothing.

An optimizer that never steps (made but unused) would keep a step from ending: when an
optimizer steps a second time before the step ended, the step ended at the previous
optimizer step (placed there after the fact), and the optimizers stepped so far are the
cycle from then on.
"""
from __future__ import annotations

import gc

import torch


def _trainable_ids(optimizer: torch.optim.Optimizer) -> set[int]:
    return {id(p) for group in optimizer.param_groups for p in group["params"]
            if getattr(p, "requires_grad", False)}


class OptimizerCycle:
    """Feed it every optimizer step; it answers where steps end."""

    def __init__(self):
        self._targets: set[int] | None = None  # parameter ids one step must cover
        self._stepped: list[tuple[int, set[int], int, int]] = []  # (optimizer, params, seq, ns)
        self._expects: bool | None = None

    def _find_targets(self, owned: set[int]) -> set[int]:
        targets: set[int] = set()
        optimizer_type = torch.optim.Optimizer
        for obj in gc.get_objects():
            # type(), not isinstance(): isinstance reads __class__, which some lazy module
            # objects answer with a deprecation warning
            if issubclass(type(obj), optimizer_type):
                try:
                    targets |= _trainable_ids(obj) & owned
                except (AttributeError, TypeError, KeyError):  # half-built or foreign object
                    continue
        return targets

    def expects_optimizer(self, owned: set[int]) -> bool:
        """Whether a torch.optim optimizer holds parameters of the profiled models (asked
        once, at the first step counted by backward: that count is then provisional)."""
        if self._expects is None:
            self._expects = bool(self._find_targets(owned)) if owned else False
        return self._expects

    def optimizer_stepped(self, optimizer, owned: set[int], seq: int,
                          time_ns: int) -> list[tuple[int, int]]:
        """The step boundaries ``(seq, time_ns)`` this optimizer step reveals (0, 1 or 2);
        ``owned``: ids of the parameters of the models profiled."""
        boundaries = []
        key = id(optimizer)
        if any(stepped == key for stepped, _, _, _ in self._stepped):
            # a second step of the same optimizer: the step ended at the previous one
            self._targets = set().union(*(params for _, params, _, _ in self._stepped))
            boundaries.append(self._stepped[-1][2:])
            self._stepped = []
        if self._targets is None:
            self._targets = self._find_targets(owned) if owned else set()
        params = _trainable_ids(optimizer) & owned if owned else set()
        self._stepped.append((key, params, seq, time_ns))
        covered = set().union(*(p for _, p, _, _ in self._stepped))
        if covered >= self._targets:
            boundaries.append((seq, time_ns))
            self._stepped = []
        return boundaries
