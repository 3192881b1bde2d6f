"""Reading a judge's answer into a reward: `(value, None)`, or `(None, reason)` when it cannot be read.

Only the judge's final answer is read, as the judge means it:
- an answer the server cut off (`finish_reason: length`) is no verdict ("cut off"): its last number
  is wherever the budget ran out, often inside the judge's reasoning;
- a reasoning judge's `<think>...</think>` is never read: the text after the last `</think>` is the
  answer; a `<think>` still open there (a judge that never finished thinking) is "unclosed think";
- of several matches the LAST is read by default (`pick: last`): the judge's conclusion comes after
  its reasoning ("3 x 4 = 12, ... Final score: 10" reads 10), and a completion the judge quotes
  (where the policy could plant "Score: 10") comes before the judge's own verdict. A judge that ends
  its answer with the quoted completion is read there: ask for the verdict last, or in a `\\boxed{}`
  or a JSON object (`read: boxed`, `read: json`), and use `pick: first` only for a judge that states
  its verdict first.

The reasons are short fixed phrases (no answer text in them), so that they can be counted:
"empty answer", "cut off", "unclosed think", "no number", "out of range", "no choice", "no boxed",
"not JSON", "no field <f>", "field <f> not a number".
"""

from __future__ import annotations

import json
import math
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: options.py picks its asker from these modules
    from pipeline.rewards.judge.options import VerdictOptions

_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_NUMBER = re.compile(_NUM)
# a score with its scale ("7/10", "7 out of 10") is one match whose value is the first number
_SCORE = re.compile(rf"(?P<n>{_NUM})(?:\s*(?:/|out of)\s*{_NUM})?", re.IGNORECASE)
_BOXED = "\\boxed{"


def read_verdict(answer: str | None, v: VerdictOptions, finish_reason: str | None = None) -> tuple[float | None, str | None]:
    """The reward `answer` gives under `v`, or None and why not (see the module docstring)."""
    if finish_reason == "length":
        return None, "cut off"
    text = answer or ""
    if "</think>" in text:
        text = text.rpartition("</think>")[2]  # the reasoning before it is not the verdict
    if "<think>" in text:
        return None, "unclosed think"
    text = text.strip()
    if not text:
        return None, "empty answer"
    if v.read == "number":
        matches = list(_SCORE.finditer(text))
        return _in_range(float(_pick(matches, v).group("n")), v) if matches else (None, "no number")
    if v.read == "choice":
        return _choice(text, v)
    if v.read == "boxed":
        boxes = _boxed(text)
        if not boxes:
            return None, "no boxed"
        inner = _pick(boxes, v).strip()
        if v.choices:
            return _choice(inner, v)
        match = _SCORE.fullmatch(inner) or _SCORE.search(inner)
        return _in_range(float(match.group("n")), v) if match else (None, "no number")
    objects = _json_objects(text)
    if not objects:
        return None, "not JSON"
    obj = _pick(objects, v)
    for key in v.field.split("."):
        if not isinstance(obj, dict) or key not in obj:
            return None, f"no field {v.field}"
        obj = obj[key]
    if isinstance(obj, str) and v.choices:
        return _choice(obj, v)
    if isinstance(obj, bool):
        obj = float(obj)
    if isinstance(obj, str) and _NUMBER.fullmatch(obj.strip()):
        obj = float(obj)
    if not isinstance(obj, int | float):
        return None, f"field {v.field} not a number"
    return _in_range(float(obj), v)


def _pick(matches: list, v: VerdictOptions):
    return matches[-1] if v.pick == "last" else matches[0]


def _in_range(x: float, v: VerdictOptions) -> tuple[float | None, str | None]:
    if not math.isfinite(x) or not v.min <= x <= v.max:
        return None, "out of range"
    return ((x - v.min) / (v.max - v.min) if v.normalize else x), None


def _choice(text: str, v: VerdictOptions) -> tuple[float | None, str | None]:
    """The choice named last (pick: last) or first in `text` (whole words, case-insensitive)."""
    found = []  # (where, value)
    for word, value in v.choices.items():
        for match in re.finditer(rf"(?<!\w){re.escape(word)}(?!\w)", text, re.IGNORECASE):
            found.append((match.start(), value))
    if not found:
        return None, "no choice"
    return _pick(sorted(found, key=lambda f: f[0]), v)[1], None


def _boxed(text: str) -> list[str]:
    """The contents of every `\\boxed{...}` (braces balanced), in order."""
    out, start = [], text.find(_BOXED)
    while start >= 0:
        depth, i = 1, start + len(_BOXED)
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            out.append(text[start + len(_BOXED): i - 1])
        start = text.find(_BOXED, i)
    return out


def _json_objects(text: str) -> list[dict]:
    """The top-level JSON objects in `text` (bare, inside a ```json fence or prose), in order."""
    decoder = json.JSONDecoder()
    out, i = [], text.find("{")
    while i >= 0:
        try:
            obj, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            i = text.find("{", i + 1)
            continue
        if isinstance(obj, dict):
            out.append(obj)
        i = text.find("{", end)
    return out
