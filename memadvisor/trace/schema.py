"""The memadvisor trace format: the contract between the profiler and every reader.

A trace is one Parquet file.  Each row is one memory event (a storage coming to life or
dying); the file's key-value metadata holds one JSON document (``TraceMeta``) describing
the run.  ``profile/`` is the only writer; ``simulate/``, reports and the dashboard only
read.  Anything that changes a column's meaning bumps ``FORMAT_VERSION`` and gets an
adapter in ``memadvisor.trace.io`` so older files keep loading.

Units are in the names: ``size_bytes``, ``time_ns``.  Strings with few distinct values
(categories, ops, modules, source files) are dictionary-encoded, which keeps a file of a
million events at a few MB and makes it load in well under a second.
"""
from __future__ import annotations

from dataclasses import dataclass, field, asdict
from typing import Any

FORMAT_NAME = "memadvisor-trace"
#: 2 added block_bytes, stream, address (CUDA allocator facts); 3 added input_ids (data flow)
FORMAT_VERSION = 3
#: key of the JSON metadata document inside the Parquet file's key-value metadata
METADATA_KEY = b"memadvisor"

# --- event actions ---------------------------------------------------------------------
ALLOC = "alloc"
FREE = "free"
ACTIONS = (ALLOC, FREE)

# --- categories -------------------------------------------------------------------------
PARAMETER = "parameter"  #: nn.Parameter storage (the fp32 master copy under AMP)
BUFFER = "buffer"  #: registered module buffers (batch-norm running stats, ...)
GRADIENT = "gradient"  #: .grad of a parameter (also the gradient being accumulated into it)
OPTIMIZER_STATE = "optimizer_state"  #: tensors in optimizer.state (momentum, exp_avg, step)
ACTIVATION = "activation"  #: saved by autograd in forward for use in backward
AUTOCAST_WEIGHT = "autocast_weight"  #: autocast's low-precision copy of a parameter
TEMPORARY = "temporary"  #: anything else made and freed while computing
INPUT = "input"  #: data the script fed to the model (batches, targets)
OTHER = "other"  #: alive before profiling started or not otherwise explained
CATEGORIES = (PARAMETER, BUFFER, GRADIENT, OPTIMIZER_STATE, ACTIVATION, AUTOCAST_WEIGHT,
              TEMPORARY, INPUT, OTHER)

# Categories of "model state": what ZeRO-style sharding divides among ranks.
MODEL_STATE_CATEGORIES = (PARAMETER, GRADIENT, OPTIMIZER_STATE)

#: dtype of a block a kernel allocated for itself (oneDNN scratch, a wrapped scalar), seen
#: only by the native allocator hook: no tensor, its shape is its byte count
RAW_BYTES_DTYPE = "bytes"

# --- phases -----------------------------------------------------------------------------
FORWARD = "forward"
BACKWARD = "backward"
OPTIMIZER = "optimizer"
OTHER_PHASE = "other"  #: data loading, zero_grad, logging, between steps
PHASES = (FORWARD, BACKWARD, OPTIMIZER, OTHER_PHASE)

# --- columns ----------------------------------------------------------------------------
#: name -> (arrow type name, meaning).  Order is the on-disk order.
COLUMNS: dict[str, tuple[str, str]] = {
    "seq": ("int64", "event order, 0-based, strictly increasing"),
    "time_ns": ("int64", "nanoseconds since the profiler started (monotonic clock)"),
    "action": ("dict", "'alloc' or 'free'"),
    "storage_id": ("int64", "identity of the storage; an alloc and its free share it"),
    "size_bytes": ("int64", "bytes of the storage (requested size, not allocator-rounded)"),
    "device": ("dict", "torch device string, e.g. 'cpu', 'cuda:0'"),
    "dtype": ("dict", "dtype of the tensor that created the storage, e.g. 'float32'; "
                      "'bytes' for a kernel's internal block (no tensor)"),
    "shape": ("dict", "shape of that tensor as comma-separated ints ('' for a scalar)"),
    "category": ("dict", "one of CATEGORIES: the storage's role over its whole life"),
    "op": ("dict", "aten op that allocated the storage, e.g. 'aten::mm' ('' if unknown)"),
    "module": ("dict", "module path active at allocation ('blocks.3.attn', '' = top); for "
               "parameters, buffers, gradients and optimizer state the owning module"),
    "phase": ("dict", "one of PHASES at the time of the event"),
    "step": ("int32", "training step index at the time of the event, 0-based"),
    "source_file": ("dict", "innermost user-code file at allocation ('' if none)"),
    "source_line": ("int32", "line number in source_file (0 if none)"),
    "source_function": ("dict", "function name in source_file"),
    # --- format 2: what a CUDA caching allocator reports about the block (0 = not known)
    "block_bytes": ("int64", "the allocator's block size holding the storage (the request "
                             "rounded, or a whole unsplit free block), as "
                             "max_memory_allocated counts it; 0 where no allocator said"),
    "stream": ("int64", "CUDA stream the block belongs to (its pool); 0 = default stream"),
    "address": ("int64", "device address of the block; 0 where not recorded"),
    # --- format 3: data flow, so that a reader can follow a dtype or a lifetime from the
    # storages an op read to the ones it made (a 16-bit plan's residual add of two 16-bit
    # tensors is 16-bit; what the fp32 trace alone cannot say)
    "input_ids": ("list", "on the alloc row of an op's output: the storage ids of the "
                          "tensors that op read (the native engine keeps the first 8); "
                          "empty on other rows and where the profiler did not see the op"),
}
COLUMN_NAMES = tuple(COLUMNS)
#: columns a writer may leave out (filled with 0) and a format-1 file lacks
OPTIONAL_ZERO_COLUMNS = ("block_bytes", "stream", "address")
#: columns a writer may leave out (filled with empty lists) and a format-1 or 2 file lacks
OPTIONAL_LIST_COLUMNS = ("input_ids",)


@dataclass
class StepInfo:
    """What the profiler learnt about one training step."""

    index: int
    start_ns: int  #: time_ns at which the step began
    end_ns: int  #: time_ns at which the step ended (optimizer step done)
    duration_s: float  #: wall time of the step
    peak_bytes: int = 0  #: peak live bytes seen by the tracker during the step
    #: torch.cuda.max_memory_allocated / reserved during the step (CUDA runs only)
    cuda_max_allocated_bytes: int | None = None
    cuda_max_reserved_bytes: int | None = None


@dataclass
class ModuleInfo:
    """One entry of the module tree (every named submodule, '' is the root)."""

    path: str
    type: str  #: class name, e.g. 'Linear'
    parameter_bytes: int  #: bytes of parameters directly owned (not recursive)
    parameter_count: int
    buffer_bytes: int
    total_parameter_bytes: int  #: including children
    repeated: bool = False  #: one of a ModuleList/Sequential of same-typed siblings
    #: a model the script calls itself: '' and each further root (a GAN's ``netG`` beside
    #: its ``netD``), which ``apply`` prepares on its own; absent in older traces
    root: bool = False


@dataclass
class TraceMeta:
    """The run's metadata, stored as JSON beside the events."""

    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    script: str = ""
    argv: list[str] = field(default_factory=list)
    cwd: str = ""
    torch_version: str = ""
    python_version: str = ""
    hostname: str = ""
    device: str = "cpu"  #: main device the model's parameters lived on
    device_name: str = ""  #: e.g. 'NVIDIA H100 80GB HBM3' or the CPU model
    world_size: int = 1
    rank: int = 0
    created_unix_s: float = 0.0
    #: outcome of the run: 'completed' (ran --steps or ended), 'error', 'interrupted', 'timeout'
    status: str = "completed"
    error: str = ""  #: one-line description when status != completed
    steps_requested: int = 0
    steps_completed: int = 0
    step_detection: str = ""  #: 'optimizer' (torch.optim hooks) or 'backward' (fallback)
    parameter_count: int = 0
    parameter_bytes: int = 0
    buffer_bytes: int = 0
    trainable_parameter_count: int = 0
    #: e.g. {'class': 'AdamW', 'hyperparameters': {'lr': 0.001, ...}, 'state_bytes': ...}
    optimizers: list[dict[str, Any]] = field(default_factory=list)
    modules: list[dict[str, Any]] = field(default_factory=list)  #: ModuleInfo dicts
    #: what is known about the batch: {'batch_size': 32, 'shapes': [[32, 128]], 'dtypes': [...],
    #: 'names': ['input_ids', ...] (argument or keyword of the root call), 'batch_dims': [0, ...]
    #: (per shape: the batch dimension, None where the tensor has none: a shared mask),
    #: 'evidence': how the batch dimension was decided}.  Traces before batch_dims (all
    #: written by profile before 2026-11-24) mean dimension 0 where it equals batch_size:
    #: read it through ``batch_dims_of``.
    batch: dict[str, Any] = field(default_factory=dict)
    steps: list[dict[str, Any]] = field(default_factory=list)  #: StepInfo dicts
    #: per (module, phase) aten op statistics: [{'module', 'phase', 'op', 'calls', 'flops'}]
    op_stats: list[dict[str, Any]] = field(default_factory=list)
    autocast: dict[str, Any] = field(default_factory=dict)  #: {'enabled': bool, 'dtype': ...}
    #: the CUDA caching allocator's own record where a GPU was used (see cuda_hooks)
    allocator: dict[str, Any] = field(default_factory=dict)
    profiler_overhead: dict[str, Any] = field(default_factory=dict)
    #: what the recording machine's kernels allocate for the trace's ops in 16-bit,
    #: measured after the run (profile/probes.py): {'convolution': [{'module',
    #: 'input_shape', 'threads', 'raw_bytes': {dtype: {'forward': [bytes, ...],
    #: 'backward': [...]}}} or {..., 'skipped': why}]}
    probes: dict[str, Any] = field(default_factory=dict)
    #: each torch.utils.data.DataLoader the script iterated (profile/data_loaders.py;
    #: docs/TRACE.md): settings, the line that made it, per step the main process's wait
    #: in ``__next__``, batch and copy bytes (``non_blocking``, pinned), workers' memory.
    #: None: not recorded (traces before 2026-11-26); []: the script iterated none
    data_loaders: list[dict[str, Any]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TraceMeta":
        known = {f for f in cls.__dataclass_fields__}
        meta = cls(**{k: v for k, v in data.items() if k in known})
        # keep unknown keys of the same major version instead of dropping them silently
        unknown = {k: v for k, v in data.items() if k not in known}
        if unknown:
            meta.extra = {**meta.extra, **unknown}
        return meta


def batch_dims_of(batch: dict[str, Any]) -> list[int | None]:
    """Each batch tensor's batch dimension; older traces (no 'batch_dims') meant dimension 0
    of every shape whose first size is the batch size."""
    shapes = batch.get("shapes") or []
    dims = batch.get("batch_dims")
    if dims is not None and len(dims) == len(shapes):
        return [None if d is None else int(d) for d in dims]
    size = batch.get("batch_size")
    return [0 if shape and size is not None and int(shape[0]) == int(size) else None
            for shape in shapes]


def shape_to_str(shape) -> str:
    return ",".join(str(int(d)) for d in shape)


def shape_from_str(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split(",")) if text else ()
