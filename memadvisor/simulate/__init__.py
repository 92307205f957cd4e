"""The simulator: predict a plan's per-rank peak memory and step-time cost from one trace.

Pure functions over a trace and a plan -- no torch, no dash (tests/simulate proves it).
``prepare(trace)`` reduces the trace to its analysed step once; ``simulate(base, plan)``
composes the techniques (see ``simulator``) and ``advise`` ranks every plan.
"""
from .hardware import Hardware, hardware, PROFILES
from .search import SearchResult, advise
from .simulator import Baseline, Prediction, max_micro_batch, prepare, simulate

__all__ = ["Baseline", "Hardware", "PROFILES", "Prediction", "SearchResult", "advise",
           "hardware", "max_micro_batch", "prepare", "simulate"]
