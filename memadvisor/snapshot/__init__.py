"""CUDA allocator snapshots (``torch.cuda.memory._dump_snapshot`` pickles) in and out.

``safe_pickle`` loads one without executing anything, ``layout`` replays its recorded
addresses to recover every block's size and the reserved memory over time, ``importer``
turns it into a memadvisor trace and ``exporter`` writes any trace back in the format
pytorch.org/memory_viz opens.  Reads and writes traces; never imports torch.
"""
from .safe_pickle import SnapshotError, load_snapshot

__all__ = ["SnapshotError", "load_snapshot"]
