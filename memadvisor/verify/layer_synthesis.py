"""A deep model's executed stream of requests, made from runs of the same model cut shallow.

Executing a plan on fake tensors costs a few hundred microseconds per op whatever the
tensors' sizes (docs/VERIFY.md), so a 760-layer model costs 190 times a 4-layer one.
Where a model repeats one layer N times, ``fake/depth.py`` runs the plan with each such
stack cut to k layers.  Runs at k = 2 and 3 differ by one layer's requests: the rows
inserted (that layer's activations, gradients, optimizer state, autocast copies, its FSDP
unit's gathers, in forward, backward and optimizer alike) and the rows whose size grows by
a fixed amount per layer (a flat buffer over all parameters, the stack of per-parameter
norms ``clip_grad_norm_`` makes).  Inserting that layer N - 2 times and growing those sizes
N - 2 times gives the N-layer stream, which the caching-allocator model then replays like
any executed trace: allocated and reserved peaks come from the same replay as a full run's,
not from extrapolating two numbers (a peak is the largest of several lines, and reserved
bytes move in segment steps: neither extrapolates).

Nothing is assumed: the same construction made for k = 4 must give the run at k = 4 request
for request (same order, sizes, ops, modules, lines) and the same modelled peaks, or the
synthesis is refused with the first difference and the plan is executed in full.

Two things are normalised first, in every run alike, because they carry no layer structure:
a run of consecutive frees is put in a fixed order (autocast's cache of weight copies frees
in hash order; the same blocks freed between the same two requests leave the allocator in
the same state in any order), and storage ids are re-paired in the result (which of several
identical live blocks a free names is decided by the order requests run, which the
alignment may pair differently).  Pure: no torch.
"""
from __future__ import annotations

import difflib
import itertools
import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..trace import schema

#: alignment key: what identifies a request apart from its size (sizes may grow per layer)
_KEY_COLUMNS = ("action", "op", "layer", "phase", "step", "source_line", "category", "dtype")
#: the same without layer roles (any layer of a stack alike)
_LOOSE_KEY_COLUMNS = tuple("any_layer" if c == "layer" else c for c in _KEY_COLUMNS)
#: what a free row shares with its storage's alloc row (phase and step are the free's own)
#: (a layer's output is freed by the next layer: a middle layer's role is not its storage's)
_STORAGE_COLUMNS = ("op", "any_layer", "source_line", "category", "dtype")
#: what a free row copies from its storage's alloc row
_ALLOC_COLUMNS = ("op", "module", "layer", "any_layer", "source_line", "source_file",
                  "source_function", "category", "dtype", "shape", "device", "stream")


class SynthesisError(ValueError):
    """The shallow runs do not differ by a repeated layer: execute in full."""


def stack_paths(modules: list[dict], layer_types: set[str], kept: int) -> list[str]:
    """Paths of the containers cut to ``kept`` layers: those whose children named 0 ..
    kept - 1 are all of a cut layer class (``meta.modules`` of the cut run)."""
    children: dict[str, list[tuple[str, str]]] = {}
    for module in modules:
        parent, _, leaf = module["path"].rpartition(".")
        if leaf.isdigit():
            children.setdefault(parent, []).append((leaf, module["type"]))
    def of_a_cut_class(kind: str) -> bool:  # FSDP2's fully_shard renames Block FSDPBlock
        return any(kind == cut or kind == "FSDP" + cut for cut in layer_types)

    return [parent for parent, kids in children.items()
            if sorted(int(leaf) for leaf, _ in kids) == list(range(kept))
            and all(of_a_cut_class(kind) for _, kind in kids)]


def _layer_names(modules: pd.Series, stacks: list[str], kept: int,
                 roles: bool = True) -> pd.Series:
    """Each module path with its index in a cut stack named by role: the first layer, a
    middle one, the last (k - 1 and k layers differ by one middle layer); without
    ``roles``, any layer ('#')."""
    pattern = re.compile(r"^(" + "|".join(re.escape(p) + r"\." if p else "" for p in stacks)
                         + r")(\d+)(?=\.|$)") if stacks else None

    def name(path: str) -> str:
        match = pattern.match(path) if pattern else None
        if match is None:
            return path
        index = int(match.group(2))
        role = "#" if not roles else "first" if index == 0 else \
            "last" if index == kept - 1 else "middle"
        return match.group(1) + role + path[match.end():]

    names = {m: name(str(m)) for m in modules.astype(str).unique()}
    return modules.astype(str).map(names)


def device_rows(events: pd.DataFrame, device: str, stacks: list[str],
                kept: int) -> pd.DataFrame:
    """The device's rows of a run whose ``stacks`` kept ``kept`` layers, with a ``layer``
    column (the module, its stack index named by role) and each run of consecutive frees
    in a fixed order (see the module doc)."""
    rows = events[(events["device"].astype(str) == device).to_numpy()].reset_index(drop=True)
    # (data flow is not replayed: the allocator model needs sizes and order)
    rows = rows.drop(columns=["input_ids"], errors="ignore")
    rows["layer"] = _layer_names(rows["module"], stacks, kept).to_numpy()
    rows["any_layer"] = _layer_names(rows["module"], stacks, kept, roles=False).to_numpy()
    return _frees_in_order(rows)


def _frees_in_order(rows: pd.DataFrame, loose_codes: np.ndarray | None = None) -> pd.DataFrame:
    """``rows`` with each run of consecutive frees sorted by key, size and where its storage
    was made (see the module doc), renumbered.  ``loose_codes``: the rows' keys without
    layer roles as codes in the keys' sorted order (:func:`_codes`), if known."""
    if rows.empty:
        return rows
    is_free = (rows["action"] == schema.FREE).to_numpy()
    # a run id per maximal block of consecutive frees (or allocs) within one step; allocs
    # keep their order (key, size and place alike: only the position sorts them)
    steps = rows["step"].to_numpy()
    run = np.cumsum(np.r_[True, (is_free[1:] != is_free[:-1]) | (steps[1:] != steps[:-1])])
    # (by the key without layer roles: the first layer's output that the last one frees
    # with two layers is a middle one's with three, and must not move in the run)
    if loose_codes is None:
        loose_codes = _codes(rows, _LOOSE_KEY_COLUMNS)
    order = pd.DataFrame({"run": run, "key": np.where(is_free, loose_codes, -1),
                          "size": np.where(is_free, rows["size_bytes"].to_numpy(), 0),
                          "made": _alloc_positions(rows), "pos": np.arange(len(rows))})
    order = order.sort_values(["run", "key", "size", "made", "pos"], kind="stable")
    rows = rows.iloc[order["pos"].to_numpy()].reset_index(drop=True)
    rows["seq"] = np.arange(len(rows), dtype=np.int64)
    return rows


def _codes(rows: pd.DataFrame, columns) -> np.ndarray:
    """The rows' keys of ``columns`` as integers in the keys' sorted order."""
    codes, _ = pd.factorize(np.array(_key_strings(rows, columns), dtype=object), sort=True)
    return codes.astype(np.int64)


def _key_strings(rows: pd.DataFrame, columns=_KEY_COLUMNS) -> list[str]:
    """One string per row of ``columns``."""
    parts = [rows[c].astype(str).to_numpy() for c in columns]
    return ["\x1f".join(p) for p in zip(*parts)]


@dataclass
class LayerModel:
    """Rows of the run at ``layers`` layers, which of them one layer inserted, and how many
    bytes a row's size grows by per layer."""
    rows: pd.DataFrame  #: the run at ``layers`` (device rows, frees in a fixed order)
    layers: int
    inserted: np.ndarray  #: bool per row: one layer's rows (repeated)
    #: bool per row: an inserted row that starts a new repeated stretch though the row
    #: before it is inserted too (``_straddling``)
    breaks: np.ndarray
    growth_bytes: np.ndarray  #: int per row: size change per added layer
    _kinds: tuple | None = None  #: the rows' storage and loose key codes and free depths

    def at(self, layers: int) -> pd.DataFrame:
        """The stream at ``layers`` layers (at least ``self.layers``)."""
        extra = layers - self.layers
        if extra < 0:
            raise SynthesisError(f"cannot remove layers ({layers} < {self.layers})")
        # rows one layer inserted come again ``extra`` times, segment by segment (rows
        # i..j inserted together are emitted i..j, i..j, ...: one layer after another)
        source, copy, segment = _by_segment(self.inserted, self.breaks, extra)
        rows = self.rows
        sizes = rows["size_bytes"].to_numpy()[source] + self.growth_bytes[source] * extra
        if (sizes < 0).any():
            raise SynthesisError("a request's size would fall below zero")
        if self._kinds is None:  # the run's own codes, once: every copy of a row shares them
            self._kinds = (_codes(rows, _STORAGE_COLUMNS), _codes(rows, _LOOSE_KEY_COLUMNS),
                           free_depths(rows))
        kinds, loose, depths = self._kinds
        is_alloc = (rows["action"] == schema.ALLOC).to_numpy()[source]
        ids, made_at = _repair_ids(is_alloc, kinds[source], sizes, copy, segment,
                                   rows["storage_id"].to_numpy()[source], depths[source])
        out = rows.iloc[source].reset_index(drop=True)
        out["size_bytes"] = sizes.astype(np.int64)
        out["storage_id"] = ids
        # a free carries its storage's columns (the alloc row's), as a recorded free does
        frees = np.flatnonzero(made_at >= 0)
        of_storage = source.copy()
        of_storage[frees] = source[made_at[frees]]
        for column in _ALLOC_COLUMNS:
            out[column] = rows[column].take(of_storage).to_numpy() \
                if not isinstance(rows[column].dtype, pd.CategoricalDtype) else \
                rows[column].take(of_storage).reset_index(drop=True)
        return _frees_in_order(out, loose[source])


def _by_segment(inserted: np.ndarray, breaks: np.ndarray,
                extra: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row positions, copy numbers and segments (-1 outside the inserted rows): each
    segment of inserted rows (maximal, or up to a break) emitted ``extra + 1`` times in a
    row, the others once."""
    positions, copies, segments = [], [], []
    edges = np.flatnonzero(np.r_[True, (inserted[1:] != inserted[:-1]) | breaks[1:], True])
    for number, (start, stop) in enumerate(zip(edges[:-1], edges[1:])):
        segment = np.arange(start, stop)
        times = extra + 1 if inserted[start] else 1
        positions.append(np.tile(segment, times))
        copies.append(np.repeat(np.arange(times), len(segment)))
        segments.append(np.full(len(segment) * times, number if inserted[start] else -1))
    if not positions:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    return np.concatenate(positions), np.concatenate(copies), np.concatenate(segments)


def free_depths(rows: pd.DataFrame) -> np.ndarray:
    """Per row: for a free, where the storage it frees stands among the live storages of the
    same kind and size, counted from the nearer end: ``d`` >= 0 is the d-th newest
    (a backward frees its own layer's activations, last in first out), ``-1 - d`` the d-th
    oldest (a model converted parameter by parameter frees the oldest copy first);
    ``NOT_A_FREE`` for an alloc."""
    keys = _key_strings(rows, _STORAGE_COLUMNS)
    sizes = rows["size_bytes"].tolist()
    is_alloc = (rows["action"] == schema.ALLOC).tolist()
    live: dict[tuple, dict[int, None]] = {}
    depths = np.full(len(rows), NOT_A_FREE, dtype=np.int64)
    for i, (storage, key) in enumerate(zip(rows["storage_id"].tolist(), zip(keys, sizes))):
        kind = live.setdefault(key, {})
        if is_alloc[i]:
            kind[storage] = None
            continue
        if storage in kind:
            oldest = list(kind).index(storage)
            newest = len(kind) - 1 - oldest
            depths[i] = newest if newest <= oldest else -1 - oldest
            del kind[storage]
    return depths


#: free_depths' value for an alloc row (or a free of a storage made before the rows)
NOT_A_FREE = np.iinfo(np.int64).min


def _repair_ids(is_alloc: np.ndarray, kinds: np.ndarray, sizes: np.ndarray,
                copy: np.ndarray, segment: np.ndarray, original: np.ndarray,
                depth: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A fresh id per request.  A free whose storage was made in the same segment (inside
    one repeated segment, or both outside them) names that storage in its own copy.  Any
    other -- a layer's input freed in its backward, an FSDP unit's gathered parameters
    freed as the next unit gathers, a forward activation freed in backward, where the
    copies come in the reverse order -- frees the live storage of the same kind and size
    at the same place from the nearer end as in the run at k layers (``free_depths``;
    identical blocks:
    which one a free names is pairing, not the run).  Returns the ids and, per free, the
    row of its storage's alloc (-1 for allocs)."""
    ids = np.empty(len(is_alloc), dtype=np.int64)
    made_at = np.full(len(is_alloc), -1, dtype=np.int64)
    row_of: dict[int, int] = {}  # new id -> its alloc row
    made_in: dict[int, int] = {}  # original id -> segment of its alloc
    live: dict[tuple, int] = {}  # (original id, copy) -> new id
    by_key: dict[tuple, dict[int, tuple]] = {}  # (key, size) -> new id -> (original, copy)
    for i, (alloc, kind, size, storage, number, part) in enumerate(zip(
            is_alloc.tolist(), kinds.tolist(), sizes.tolist(), original.tolist(),
            copy.tolist(), segment.tolist())):
        key = (kind, size)
        name = (storage, number)
        if alloc:
            new = len(row_of)
            live[name] = new
            made_in[storage] = part
            by_key.setdefault(key, {})[new] = name
            row_of[new] = i
            ids[i] = new
            continue
        candidates = by_key.get(key) or {}
        new = live.get(name) if made_in.get(storage) == part else None
        if (new is None or new not in candidates) and depth[i] != NOT_A_FREE:
            order = reversed(candidates) if depth[i] >= 0 else iter(candidates)
            place = int(depth[i]) if depth[i] >= 0 else -1 - int(depth[i])
            new = next(itertools.islice(order, place, None), None)
        if new is None or new not in candidates:
            raise SynthesisError(f"request {i:,} frees a storage of {size:,} B where none "
                                 "of its kind is live")
        live.pop(candidates.pop(new), None)
        ids[i] = new
        made_at[i] = row_of[new]
    return ids, made_at


def fit(shallow: pd.DataFrame, deeper: pd.DataFrame, layers: int) -> LayerModel:
    """The model of one layer from runs at ``layers - 1`` (``shallow``) and ``layers``
    (``deeper``) layers, both from :func:`device_rows`: aligned request by request with
    sizes and layer roles (a layer's Adam states for a weight and its bias differ only by
    size), then, where that finds a change, without them: a request whose size grows per
    layer, or a layer's output that the last layer frees (the first layer's with two
    layers, a middle one's with three)."""
    inserted = np.zeros(len(deeper), dtype=bool)
    growth = np.zeros(len(deeper), dtype=np.int64)
    size_a, size_b = shallow["size_bytes"].to_numpy(), deeper["size_bytes"].to_numpy()
    sized_a = [f"{k}\x1f{s}" for k, s in zip(_key_strings(shallow), size_a.tolist())]
    sized_b = [f"{k}\x1f{s}" for k, s in zip(_key_strings(deeper), size_b.tolist())]
    keys_a = _key_strings(shallow, _LOOSE_KEY_COLUMNS)
    keys_b = _key_strings(deeper, _LOOSE_KEY_COLUMNS)

    def refuse(tag: str, i: int) -> SynthesisError:
        what = "removed" if tag == "delete" else "changed"
        row = shallow.iloc[min(i, len(shallow) - 1)]
        return SynthesisError(
            f"one more layer {what} a request ({row['action']} {row['op']} in "
            f"{row['module'] or 'the script'}, step {row['step']}, line "
            f"{row['source_line']}): the runs do not differ by one layer's requests")

    def align(a, b, offset_a: int, offset_b: int, sized: bool) -> None:
        matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            i1, i2, j1, j2 = i1 + offset_a, i2 + offset_a, j1 + offset_b, j2 + offset_b
            if tag == "equal":
                growth[j1:j2] = size_b[j1:j2] - size_a[i1:i2]
            elif tag == "insert":
                inserted[j1:j2] = True
            elif tag == "replace" and sized:
                align(keys_a[i1:i2], keys_b[j1:j2], i1, j1, sized=False)
            else:
                raise refuse(tag, i1)

    align(sized_a, sized_b, 0, 0, sized=True)
    return LayerModel(rows=deeper, layers=layers, inserted=inserted, growth_bytes=growth,
                      breaks=_straddling(inserted, deeper, keys_b))


def _straddling(inserted: np.ndarray, rows: pd.DataFrame, keys: list[str]) -> np.ndarray:
    """Breaks inside stretches of inserted rows that straddle two runs, e.g. one layer's
    outputs of a foreach op (allocs of one kind, after the other layers' own) then its
    frees of them (before the other layers'), or the end of one parameter group's frees
    then the start of the next group's allocs, which the alignment may put side by side.
    Repeated as one stretch they would interleave the two runs; each part belongs to its
    own: where a stretch is one kind of request (``keys``: with the action) continuing the
    row before it, then another continuing the row after it, it breaks between them."""
    breaks = np.zeros(len(inserted), dtype=bool)
    is_alloc = (rows["action"] == schema.ALLOC).to_numpy()
    edges = np.flatnonzero(np.r_[True, inserted[1:] != inserted[:-1], True])
    for start, stop in zip(edges[:-1], edges[1:]):
        if not inserted[start] or start == 0 or stop >= len(inserted):
            continue
        changes = np.flatnonzero(is_alloc[start + 1:stop] != is_alloc[start:stop - 1])
        if len(changes) != 1:
            continue
        turn = start + 1 + int(changes[0])
        before, after = set(keys[start:turn]), set(keys[turn:stop])
        if before == {keys[start - 1]} and after == {keys[stop]}:
            breaks[turn] = True
    return breaks


def first_difference(made: pd.DataFrame, ran: pd.DataFrame) -> str:
    """'' when ``made`` has ``ran``'s requests in order (key and size), else the first
    difference in words.  Which of several identical live blocks a free names is not
    compared (:func:`pairing_differences`)."""
    if len(made) != len(ran):
        return f"{len(made):,} requests made, {len(ran):,} ran"
    keys_made, keys_ran = _key_strings(made), _key_strings(ran)
    sizes_made, sizes_ran = made["size_bytes"].to_numpy(), ran["size_bytes"].to_numpy()
    for i, (km, kr) in enumerate(zip(keys_made, keys_ran)):
        if km != kr or sizes_made[i] != sizes_ran[i]:
            row = ran.iloc[i]
            return (f"request {i:,} differs ({row['action']} {row['op']} in "
                    f"{row['module'] or 'the script'}: {sizes_ran[i]:,} B ran, "
                    f"{sizes_made[i]:,} B made)")
    return ""


def pairing_differences(made: pd.DataFrame, ran: pd.DataFrame) -> int:
    """How many frees of ``made`` free a storage made at another position than ``ran``'s
    free at the same position does (same requests: :func:`first_difference` is '')."""
    return int((_alloc_positions(made) != _alloc_positions(ran)).sum())


def _alloc_positions(rows: pd.DataFrame) -> np.ndarray:
    """Per row: for a free, the position of its storage's alloc (-2: made before the
    rows); -1 for an alloc.  Storage ids are not reused within a run."""
    is_alloc = (rows["action"] == schema.ALLOC).to_numpy()
    ids = rows["storage_id"].to_numpy()
    made = pd.Series(np.flatnonzero(is_alloc), index=ids[is_alloc])
    positions = np.full(len(rows), -1, dtype=np.int64)
    positions[~is_alloc] = made.reindex(ids[~is_alloc]).fillna(-2).to_numpy(np.int64)
    return positions
