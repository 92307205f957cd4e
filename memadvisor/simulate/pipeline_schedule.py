"""The order in which torch 2.13's pipeline schedules run one rank's forwards and backwards
(``torch/distributed/pipelining/schedules.py``), rebuilt in pure Python so the simulator can
count what each rank holds at each backward and how long the pipeline idles.

* ``gpipe`` (``ScheduleGPipe``): every forward, then every backward.
* ``1f1b`` (``Schedule1F1B``): stage s runs min(M, P - s) forwards, then a backward and a
  forward in turn while forwards remain, then the remaining backwards.
* ``interleaved`` (``ScheduleInterleaved1F1B``): rank r holds stages r, r + P, ...
  (V of them); M micro-batches go in rounds of M // max(1, M // P); the warm-up runs
  (V - 1) x (micro-batches per round) + 2 (P - 1 - r) forwards (at most V x M), moving to
  the rank's next stage after each round, then one forward and one backward in turn
  (backwards from the rank's last stage down), then the remaining backwards.
  ``tests/simulate/test_pipeline_schedule.py`` checks this against torch's own
  ``_calculate_single_rank_operations``.

An action is (``"F"`` or ``"B"``, local stage index 0..V-1, micro-batch).
"""
from __future__ import annotations

from collections import defaultdict

#: relative cost of a backward (input and weight gradients) to its forward, for the bubble
BACKWARD_TO_FORWARD = 2.0


def rank_actions(schedule: str, num_ranks: int, stages_per_rank: int, microbatches: int,
                 rank: int) -> list[tuple[str, int, int]]:
    """The compute actions rank ``rank`` runs, in order."""
    m = microbatches
    if schedule == "gpipe":
        return [("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)]
    if schedule == "1f1b":
        warmup = min(m, num_ranks - rank)
        actions = [("F", 0, i) for i in range(warmup)]
        forward, backward = warmup, 0
        while True:
            actions.append(("B", 0, backward))
            backward += 1
            if forward == m:
                break
            actions.append(("F", 0, forward))
            forward += 1
        actions += [("B", 0, i) for i in range(backward, m)]
        return actions
    if schedule == "interleaved":
        return _interleaved(num_ranks, stages_per_rank, m, rank)
    raise ValueError(f"unknown schedule {schedule!r}")


def _interleaved(num_ranks: int, stages_per_rank: int, microbatches: int,
                 rank: int) -> list[tuple[str, int, int]]:
    v = stages_per_rank
    rounds = max(1, microbatches // num_ranks)
    per_round = microbatches // rounds
    warmup = min((v - 1) * per_round + 2 * (num_ranks - 1 - rank), microbatches * v)
    total = microbatches * v
    forward_next: dict[int, int] = defaultdict(int)
    backward_next: dict[int, int] = defaultdict(int)

    def forward(op):
        local = (op // per_round) % v
        forward_next[local] += 1
        return ("F", local, forward_next[local] - 1)

    def backward(op):
        local = v - 1 - ((op - warmup) // per_round) % v
        backward_next[local] += 1
        return ("B", local, backward_next[local] - 1)

    actions = [forward(op) for op in range(warmup)]
    for op in range(warmup, total):
        actions += [forward(op), backward(op)]
    actions += [backward(op) for op in range(total, total + warmup)]
    return actions


def in_flight_at_backwards(actions: list[tuple[str, int, int]], stages_per_rank: int):
    """Per backward action: (local stage, micro-batches in flight on each local stage --
    forwards run, backwards not yet finished, this one included -- and the backwards each
    local stage ran before)."""
    held = [0] * stages_per_rank
    done = [0] * stages_per_rank
    found = []
    for kind, local, _ in actions:
        if kind == "F":
            held[local] += 1
            continue
        found.append((local, tuple(held), tuple(done)))
        held[local] -= 1
        done[local] += 1
    return found


def bubble_fraction(schedule: str, num_ranks: int, stages_per_rank: int,
                    microbatches: int) -> float:
    """Share of the step a rank idles, from running every rank's actions in torch's order
    with their dependencies (a stage's forward after the previous stage's, its backward
    after the next stage's), each stage's forward 1 / V of a rank's and its backward
    ``BACKWARD_TO_FORWARD`` times that; communication free."""
    p, v, m = num_ranks, stages_per_rank, microbatches
    if p <= 1:
        return 0.0
    last = p * v - 1
    orders = [rank_actions(schedule, p, v, m, r) for r in range(p)]
    position = [0] * p
    free_at = [0.0] * p
    finished: dict[tuple[str, int, int], float] = {}
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            while position[r] < len(orders[r]):
                kind, local, mb = orders[r][position[r]]
                stage = local * p + r
                needs = ([("F", stage - 1, mb)] if kind == "F" and stage > 0 else
                         [("F", stage, mb)] + ([("B", stage + 1, mb)] if stage < last
                                               else []) if kind == "B" else [])
                if any(n not in finished for n in needs):
                    break
                start = max([free_at[r]] + [finished[n] for n in needs])
                duration = (1.0 if kind == "F" else BACKWARD_TO_FORWARD) / v
                finished[(kind, stage, mb)] = free_at[r] = start + duration
                position[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"{schedule} schedule deadlocks (P={p}, V={v}, M={m})")
    work = m * (1.0 + BACKWARD_TO_FORWARD)
    return 1.0 - work / max(free_at)
