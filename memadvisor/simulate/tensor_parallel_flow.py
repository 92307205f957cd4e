"""Which tensors of a split block ``tp`` really splits: those computed from a split one.

A block's path says where its ops run, not what they compute on.  A model whose MLP
Linears are its own children (a classifier's ``fc1``/``fc2`` beside its convolutions, the
pytorch/examples mnist shape) makes the whole model the block; an MLP module that
normalises its input before its up projection runs that norm on the whole input.  Under
``parallelize_module`` only what is computed from a column-parallel Linear's output (in
forward) or from a row-parallel Linear's input gradient (in backward) is a rank's slice;
the partial sums (a row-parallel output, a column-parallel input gradient) and everything
computed from whole tensors stay whole.  So the split follows the recorded data flow
(``Timeline.reads``) from those sources to the partial sums; measured: zoo/mnist_under_if
``tp=2`` was predicted 30% under the run, its convolutions' activations halved.

Pure numpy: a breadth-first walk over the readers of each newly split row.
"""
from __future__ import annotations

import numpy as np

from .replay import Timeline


def split_by_data_flow(timeline: Timeline, candidates: np.ndarray, sources: np.ndarray
                       ) -> np.ndarray | None:
    """Rows split: ``sources`` and every row of ``candidates`` that reads a split row
    (transitively, through candidates only).  None where the trace holds no data flow
    (then the caller keeps the block's path as the rule)."""
    reads = timeline.reads
    if reads is None or not len(reads.rows):
        return None
    rows = len(timeline)
    counts = np.diff(reads.offsets[:rows + 1])
    reader = np.repeat(np.arange(rows), counts)
    read = reads.rows[:len(reader)]
    keep = candidates[reader]  # only edges into rows that may be split
    reader, read = reader[keep], read[keep]
    order = np.argsort(read, kind="stable")
    read, reader = read[order], reader[order]
    starts = np.searchsorted(read, np.arange(rows + 1))
    split = sources.copy()
    frontier = np.flatnonzero(sources)
    while len(frontier):
        lo, lengths = starts[frontier], starts[frontier + 1] - starts[frontier]
        lo, lengths = lo[lengths > 0], lengths[lengths > 0]
        if not len(lo):
            break
        # the readers of every frontier row, as one index array
        take = np.repeat(lo - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths) \
            + np.arange(int(lengths.sum()))
        nxt = np.unique(reader[take])
        nxt = nxt[~split[nxt]]
        split[nxt] = True
        frontier = nxt
    return split
