"""The CUDA caching allocator's settings (``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF``)
as the allocator model honours them, parsed from the variable's text or from a snapshot's
``allocator_settings``.

Honoured: ``max_split_size_mb`` (blocks at or over it are never split and serve only
requests within 20 MiB of their size), ``roundup_power2_divisions`` (large requests round
up to one of N divisions between powers of two, one N or per size bucket), and
``expandable_segments`` (``allocator._expandable``).  Refused by name, because the model
would silently be wrong: ``garbage_collection_threshold`` (frees cached blocks as usage
nears the device's limit), ``backend:cudaMallocAsync`` (the driver's allocator, no
caching model here).  Settings that move no device memory (pinned host memory, locks) are
accepted and ignored.  Rules: c10/cuda/CUDAAllocatorConfig.cpp, CUDACachingAllocator.cpp.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import UserError

#: roundup_power2_divisions buckets: powers of two from 1 MiB to 32 GiB (16 of them)
BUCKET_START_LOG2 = 20
BUCKETS = 16
MIN_BLOCK = 512
_IGNORED = {"pinned_num_register_threads", "release_lock_on_cudamalloc",
            "pinned_use_cuda_host_register", "pinned_use_background_threads",
            "graph_capture_record_stream_reuse", "per_process_memory_fraction",
            "pinned_reserve_segment_size_mb", "large_segment_size_mb", "PYTORCH_CUDA_ALLOC_CONF"}


@dataclass(frozen=True)
class AllocatorConfig:
    max_split_size_bytes: int = 0  #: 0: no limit (the default, SIZE_MAX in c10)
    #: divisions per size bucket (0 or 1: plain 512-byte rounding)
    roundup_power2_divisions: tuple[int, ...] = field(default=(0,) * BUCKETS)
    expandable_segments: bool = False

    @property
    def default_rules(self) -> bool:
        """True when the compiled replay loop (default rules only) can run it."""
        return not self.max_split_size_bytes and not any(
            d > 1 for d in self.roundup_power2_divisions)

    def round_size(self, size: int) -> int:
        if size < MIN_BLOCK:
            return MIN_BLOCK
        divisions = self.roundup_power2_divisions[
            min(max(size.bit_length() - 1 - BUCKET_START_LOG2, 0), BUCKETS - 1)]
        if divisions > 1 and size > MIN_BLOCK * divisions:
            return _roundup_power2_next_division(size, divisions)
        return -(-size // MIN_BLOCK) * MIN_BLOCK


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    below = size & ~(step - 1)
    return size if below == size else below + step


def parse_alloc_conf(text: str | None) -> AllocatorConfig:
    """``PYTORCH_CUDA_ALLOC_CONF``'s text ("key:value,key:value")."""
    if not text or not text.strip():
        return AllocatorConfig()
    values: dict = {}
    for item in _split_items(text):
        key, sep, value = item.partition(":")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            raise UserError(f"PYTORCH_CUDA_ALLOC_CONF: {item!r} is not 'key:value'")
        values[key] = value
    return _config(values, "PYTORCH_CUDA_ALLOC_CONF")


def config_from_snapshot(settings: dict | None, strict: bool = True) -> AllocatorConfig:
    """A snapshot's ``allocator_settings`` (torch >= 2.1's _snapshot()).  ``strict`` False:
    keep only what shapes blocks (rounding, splitting), for replaying recorded addresses,
    where settings the model cannot simulate do not matter."""
    settings = dict(settings or {})
    values = {}
    split = settings.get("max_split_size", -1)
    if isinstance(split, int) and 0 < split < (1 << 62):
        values["max_split_size_mb"] = split / 2**20
    divisions = settings.get("roundup_power2_divisions")
    if isinstance(divisions, dict) and any(int(v or 0) > 1 for v in divisions.values()):
        values["roundup_power2_divisions"] = [int(divisions[k] or 0) for k in sorted(
            divisions, key=lambda k: int(k))][:BUCKETS]
    if settings.get("expandable_segments"):
        values["expandable_segments"] = "True"
    threshold = settings.get("garbage_collection_threshold", 0) or 0
    if threshold and strict:
        values["garbage_collection_threshold"] = str(threshold)
    return _config(values, "the snapshot's allocator settings")


def _split_items(text: str) -> list[str]:
    # commas separate items, except inside roundup_power2_divisions' [..] list
    items, depth, current = [], 0, ""
    for char in text:
        depth += char == "["
        depth -= char == "]"
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    return [i for i in items + [current] if i.strip()]


def _config(values: dict, where: str) -> AllocatorConfig:
    max_split = 0
    divisions = (0,) * BUCKETS
    expandable = False
    for key, value in values.items():
        if key == "max_split_size_mb":
            try:
                megabytes = float(value)
            except ValueError:
                raise UserError(f"{where}: max_split_size_mb {value!r} is not a number") from None
            if megabytes <= 20:  # c10 requires more than kLargeBuffer
                raise UserError(f"{where}: max_split_size_mb must be over 20 (got {value})")
            max_split = int(megabytes * 2**20)
        elif key == "roundup_power2_divisions":
            divisions = _divisions(value, where)
        elif key == "expandable_segments":
            expandable = str(value).lower() in ("true", "1")
        elif key == "backend":
            if str(value) != "native":
                raise UserError(f"{where}: backend:{value} is not modelled (only the native "
                                "caching allocator is)")
        elif key == "garbage_collection_threshold":
            raise UserError(f"{where}: garbage_collection_threshold is not modelled (it frees "
                            "cached blocks as usage nears the device limit); predict without "
                            "it, or unset it")
        elif key not in _IGNORED:
            raise UserError(f"{where}: unknown allocator setting {key!r}")
    return AllocatorConfig(max_split, divisions, expandable)


def _divisions(value, where: str) -> tuple[int, ...]:
    if isinstance(value, list):
        numbers = [int(v) for v in value] + [0] * BUCKETS
        return tuple(numbers[:BUCKETS])
    text = str(value).strip()
    if re.fullmatch(r"\d+", text):
        return (_power_of_two(int(text), where),) * BUCKETS
    match = re.fullmatch(r"\[(.*)\]", text)
    if not match:
        raise UserError(f"{where}: roundup_power2_divisions {text!r}: expected N or "
                        "[SIZE_MB:N,...]")
    out, last = [0] * BUCKETS, None
    for entry in match.group(1).split(","):
        size, sep, count = entry.partition(":")
        if not sep:
            raise UserError(f"{where}: roundup_power2_divisions entry {entry!r} is not "
                            "SIZE_MB:N")
        count_value = _power_of_two(int(count), where)
        if size.strip() == ">":
            for index in range(0 if last is None else last + 1, BUCKETS):
                out[index] = count_value
            continue
        index = max(int(size).bit_length() - 1, 0)
        if index < BUCKETS:
            out[index] = count_value
            last = index
    return tuple(out)


def _power_of_two(n: int, where: str) -> int:
    if n and n & (n - 1):
        raise UserError(f"{where}: roundup_power2_divisions {n} is not a power of two")
    return n
