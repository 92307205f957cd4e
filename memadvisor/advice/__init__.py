"""Advice beyond plans: code and setting changes a trace shows would save memory or time.

Each kind is one module with one provider, ``provider(context) -> list[Advice]``, reading
the trace as the simulator does (pure functions over its columns, no torch import: a test
proves it).  ``collect`` runs every provider in ``PROVIDERS``; a new kind appends its
provider there (one line) and needs nothing else here.

An ``Advice`` names what it concerns in bytes (saved at the analysed step's peak, the one
figure a budget cares about) or seconds (per step), where to change it (a source line or
an environment variable), and why -- or why not: a change that would break autograd or the
script is listed as ``refused`` with its reason, and what the trace does not record is
said (``missing``) rather than guessed; a measured figure that implies no change by itself
(the input side's time per step) is ``info``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from ..trace.io import Trace

#: statuses: a change to make, one not to make (and why), what the trace cannot tell, or a
#: measured figure that implies no change by itself
SUGGESTED, REFUSED, MISSING, INFO = "suggested", "refused", "missing", "info"


@dataclass(kw_only=True)
class Advice:
    kind: str  #: 'inplace', 'allocator_settings', 'data_loading', ...
    title: str  #: one line: what to change
    #: bytes the change takes off the analysed step's peak (0: it does not lower the peak)
    bytes_saved: int = 0
    seconds: float | None = None  #: seconds per step it concerns, where it is about time
    location: str = ""  #: 'file:line' of the code to change, or the setting's name
    reason: str = ""  #: why it saves (or, refused, why not); how the figure was found
    status: str = SUGGESTED
    #: figures behind the title (JSON-ready): e.g. transient bytes, the setting's text
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class AdviceContext:
    """What providers read: the trace (events still loaded), the simulator's baseline of
    it (``simulate.Baseline``: the analysed step's timeline) and the target hardware."""

    trace: Trace
    base: Any  #: simulate.Baseline
    hardware: Any  #: simulate.Hardware
    #: allocator settings the run already uses (``PYTORCH_CUDA_ALLOC_CONF`` text, e.g. from
    #: ``advise --expandable-segments``); None: the ones the trace recorded
    alloc_conf: str | None = None

    @property
    def step_start(self) -> int:
        """Position in ``trace.events`` of the analysed step's first event."""
        from ..trace.analysis import analysed_step, step_slice
        return step_slice(self.trace.events, analysed_step(self.trace)).start


Provider = Callable[[AdviceContext], list[Advice]]


def _providers() -> list[Provider]:
    from .allocator_settings import allocator_settings_advice
    from .data_loading import data_loading_advice
    from .inplace import inplace_advice
    return [inplace_advice, allocator_settings_advice, data_loading_advice]


#: the providers ``collect`` runs, in the order their advice is shown; a new kind of advice
#: appends its function here
PROVIDERS: list[Provider] = _providers()


def collect(trace: Trace, base, hardware, providers: list[Provider] | None = None,
            alloc_conf: str | None = None) -> list[Advice]:
    """Every provider's advice for ``trace`` on ``hardware``: suggested first (most bytes
    saved, then most seconds), then refused, measured figures, what is missing; within a
    status, kinds in ``PROVIDERS``' order."""
    context = AdviceContext(trace, base, hardware, alloc_conf)
    found: list[Advice] = []
    for provider in PROVIDERS if providers is None else providers:
        found += provider(context)
    rank = {SUGGESTED: 0, REFUSED: 1, INFO: 2, MISSING: 3}
    order = {kind: i for i, kind in enumerate(dict.fromkeys(a.kind for a in found))}
    return sorted(found, key=lambda a: (rank.get(a.status, 4), order[a.kind],
                                        -a.bytes_saved, -(a.seconds or 0.0)))


def advice_dicts(advice: list[Advice]) -> list[dict[str, Any]]:
    return [a.to_dict() for a in advice]
