"""Attribute patches that are undone in reverse order, exactly once."""
from __future__ import annotations

_MISSING = object()


class Patches:
    """``patches.set(obj, "name", value)`` now, ``patches.undo()`` later.  Patching the
    same attribute twice keeps the first original, so undo restores what was there before
    fake execution began."""

    def __init__(self):
        self._saved: list[tuple[object, str, object]] = []

    def set(self, obj: object, name: str, value: object) -> None:
        self._saved.append((obj, name, obj.__dict__.get(name, _MISSING)
                            if isinstance(obj, type) else getattr(obj, name, _MISSING)))
        setattr(obj, name, value)

    def append(self, items: list, item: object) -> None:
        """Append ``item`` to the list ``items`` (if absent) until undo."""
        if item not in items:
            items.append(item)
            self._saved.append((items, "", item))

    def undo(self) -> None:
        while self._saved:
            obj, name, old = self._saved.pop()
            if isinstance(obj, list):
                if old in obj:
                    obj.remove(old)
                continue
            if old is _MISSING:
                try:
                    delattr(obj, name)
                except AttributeError:
                    pass
            else:
                setattr(obj, name, old)
