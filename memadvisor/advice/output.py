"""The advice as text: the section ``advise`` prints after its plans (``--json`` carries the
same list, whole, under "advice")."""
from __future__ import annotations

import os

from ..units import format_bytes
from . import INFO, MISSING, REFUSED, SUGGESTED

#: how many of each status the text shows (the JSON has them all)
SHOWN = {SUGGESTED: 8, REFUSED: 5, INFO: 5, MISSING: 5}
HEADINGS = {SUGGESTED: "suggested", REFUSED: "refused (would break autograd or the script)",
            INFO: "measured", MISSING: "not known from the trace"}


def advice_text(advice: list[dict], base_folder: str = "") -> str:
    lines = ["", "advice beyond plans (read from the trace; bytes are off the analysed "
                 "step's peak):"]
    if not advice:
        return "\n".join(lines + ["  none: no in-place change, allocator setting or data "
                                  "loading change the trace shows would save anything"])
    for status in (SUGGESTED, REFUSED, INFO, MISSING):
        items = [a for a in advice if a["status"] == status]
        if not items:
            continue
        lines.append(f"  {HEADINGS[status]}:")
        for item in items[:SHOWN[status]]:
            lines.append(f"  - {_headline(item, base_folder)}")
            lines.append(f"      {item['reason']}")
        if len(items) > SHOWN[status]:
            lines.append(f"    ({len(items) - SHOWN[status]} more in --json)")
    return "\n".join(lines)


def _headline(item: dict, base_folder: str) -> str:
    text = item["title"]
    where = short_location(item["location"], base_folder)
    if where:
        text += f"  [{where}]"
    figures = []
    if item["status"] == SUGGESTED and item["kind"] != "data_loading":
        figures.append(f"saves {format_bytes(item['bytes_saved'])}"
                       + (" reserved" if item["kind"] == "allocator_settings" else
                          " at the peak"))
    if item.get("seconds") is not None:
        figures.append(f"{item['seconds'] * 1e3:.2f} ms per step")
    return text + (f": {', '.join(figures)}" if figures else "")


def short_location(location: str, base_folder: str) -> str:
    """A source location relative to the run's folder where it lies inside it."""
    if base_folder and location.startswith(base_folder.rstrip(os.sep) + os.sep):
        return location[len(base_folder.rstrip(os.sep)) + 1:]
    return location
