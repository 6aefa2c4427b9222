"""Split prompts into units (lines), tell shared units from variable ones, find
volatile values (timestamps, dates, uuids, ids), and reorder units so shared
text comes first.

A unit is one non-blank line together with the blank lines after it, so
moving a unit keeps the paragraph spacing. A unit is *shared* when its text
appears in at least two prompts of the set; it is *variable* otherwise.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Sequence

# Most specific first: a timestamp contains a date and a time.
VOLATILE_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("timestamp", re.compile(r"\b\d{4}-\d{2}-\d{2}[T ]\d{1,2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}:?\d{2})?")),
    ("uuid", re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b")),
    ("date", re.compile(r"\b(\d{4}-\d{2}-\d{2}|\d{1,2}/\d{1,2}/\d{2,4}|"
                        r"(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.? \d{1,2},? \d{4})\b")),
    ("time", re.compile(r"\b\d{1,2}:\d{2}(:\d{2})?\b")),
    ("epoch", re.compile(r"\b1\d{9}(\d{3})?\b")),
    ("hex id", re.compile(r"\b(?=[0-9a-fA-F]*\d)(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{12,}\b")),
    ("id", re.compile(r"\b(?:id|ID|Id)\s*[:=#]\s*[\w-]{4,}")),
)


@dataclass(frozen=True)
class Volatile:
    kind: str
    text: str
    start: int  # offset in the unit
    end: int


def find_volatile(text: str) -> list[Volatile]:
    """Non-overlapping volatile values in text, in order."""
    found: list[Volatile] = []
    taken: list[tuple[int, int]] = []
    for kind, pattern in VOLATILE_PATTERNS:
        for m in pattern.finditer(text):
            if any(m.start() < e and s < m.end() for s, e in taken):
                continue
            taken.append((m.start(), m.end()))
            found.append(Volatile(kind, m.group(0), m.start(), m.end()))
    return sorted(found, key=lambda v: v.start)


def mask_volatile(text: str) -> str:
    """text with each volatile value replaced by <kind> (groups spans of the same shape)."""
    out, pos = [], 0
    for v in find_volatile(text):
        out += [text[pos:v.start], f"<{v.kind}>"]
        pos = v.end
    return "".join(out) + text[pos:]


def split_units(text: str) -> list[str]:
    """Lines, each with its newline and any blank lines after it; ''.join(units) == text."""
    units: list[str] = []
    for line in text.splitlines(keepends=True):
        if units and not line.strip():
            units[-1] += line
        else:
            units.append(line)
    return units


def unit_key(unit: str) -> str:
    return unit.strip()


def shared_keys(unit_lists: Iterable[Sequence[str]]) -> set[str]:
    """Unit texts that appear in at least two of the given prompts."""
    counts: Counter[str] = Counter()
    for units in unit_lists:
        counts.update({unit_key(u) for u in units})
    return {k for k, n in counts.items() if n >= 2 or not k}


def reorder(units: Sequence[str], shared: set[str]) -> str:
    """Shared units first (in their order), then the variable ones (in theirs)."""
    if not units:
        return ""
    first = [u for u in units if unit_key(u) in shared]
    last = [u for u in units if unit_key(u) not in shared]
    ordered = first + last
    ends_with_newline = units[-1].endswith("\n")
    out = [u if u.endswith("\n") else u + "\n" for u in ordered]
    if not ends_with_newline:
        out[-1] = out[-1].rstrip("\n")
    return "".join(out)


@dataclass(frozen=True)
class Break:
    """The first variable unit of a prompt that precedes shared text."""

    unit_index: int
    char_start: int  # offset of the unit in the prompt text
    unit: str
    volatile: tuple[Volatile, ...]
    shared_after: int  # shared units after it


def first_break(units: Sequence[str], shared: set[str]) -> Break | None:
    offset = 0
    for i, u in enumerate(units):
        if unit_key(u) not in shared:
            after = sum(1 for v in units[i + 1:] if unit_key(v) in shared and unit_key(v))
            if after:
                return Break(i, offset, u, tuple(find_volatile(u)), after)
            return None
        offset += len(u)
    return None
