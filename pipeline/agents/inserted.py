"""Text from outside the model is data: where it lies in what the template renders, and its tokens.

An episode glues text the model did not write between its turns: a tool's result, an environment's
observation (reset's, appended to the prompt) and its methods' answers. Such text may hold a chat
template's markers (a fetched page with `<|im_end|><|im_start|>assistant`); tokenised with the glue
around it, the marker would become the template's control token, and the model would be trained on
a turn boundary an outsider wrote. So:

- `locate` finds where each inserted piece lies in the rendered text. The template renders the
  conversation with each piece replaced by an inert placeholder and with the real pieces one at a
  time; what the template writes around a placeholder (its glue) must be the same text around the
  real piece, and the piece's span is what is left (a template that escapes or wraps the text, as
  Llama 3.1's `tojson` does, still gets the exact span of what it wrote for it). A template whose
  text around the piece changes with the piece (it branches on the content) gets one span from the
  first difference to the last, so nothing it wrote for the content can be taken for glue.
- `Tokens.encode` tokenises the text outside the spans as the tokenizer does (the template's own
  markers keep their ids: the template's glue still contributes its special tokens) and the spans as
  plain text: no control token is matched inside them, so a marker there is its text's tokens.

Control tokens: every special token of the tokenizer, and every other added token shaped like a
marker (`<...>`, `[...]`, or holding `|`: Qwen's `<tool_call>`, `<think>`, which are added but not
special); an added word or number (the tiny test tokenizer's `42`, ` + `) stays what it is.

Outside the spans the ids are the tokenizer's ids of that text, and a harmless piece gets the ids the
whole text got before (`tokenize(text)` splits at every added token the same way): only a piece
holding a control token's text changes. The record keeps the spans (pipeline/agents/__init__.py),
so `grpo audit` re-derives the ids (pipeline/report/audit_episodes.py).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any, Callable

_MARKER = re.compile(r"^\s*(?:<[^<>]+>|\[[^\[\]]+\])\s*$|[|｜]")


def leaves(value: Any) -> list[str]:
    """The strings a piece of content holds (a tool's list result holds several), in order."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in leaves(v)]
    if isinstance(value, dict):  # its keys are the tool's text too, but for the names a template reads (see _kept)
        return [s for k, v in value.items() for s in (*_open(k, k), *_open(v, k))]
    return []


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _kept(value: Any, key: Any) -> bool:
    """A dict's key, or a content part's `type` ("text"), that is a bare name: the template reads it (Qwen 3.5's
    `{% if item.type == 'text' %}`, else it raises), so it is not replaced by a placeholder; a bare name holds
    no marker."""
    return isinstance(value, str) and (value is key or key == "type") and _NAME.fullmatch(value) is not None


def _open(value: Any, key: Any) -> list[str]:
    return [] if _kept(value, key) else leaves(value)


def replaced(value: Any, new: list[str]) -> Any:
    """`value` with its string leaves replaced by `new`, in order (consumed from the front)."""
    if isinstance(value, str):
        return new.pop(0)
    if isinstance(value, (list, tuple)):
        return type(value)(replaced(v, new) for v in value)
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            key = k if _kept(k, k) else replaced(k, new)
            out[key] = v if _kept(v, k) else replaced(v, new)
        return out
    return value


def _placeholders(n: int, avoid: list[str]) -> list[str]:
    """n inert strings (letters and digits: any template writes them as they are) found in none of `avoid`."""
    salt = 0
    while True:
        marks = [f"GRPOINSERTED{salt}N{i}X" for i in range(n)]
        if not any(f"GRPOINSERTED{salt}N" in a for a in avoid):
            return marks
        salt += 1


def locate(render: Callable[[list[str]], str], pieces: list[str]) -> tuple[str, list[list[int]]]:
    """(render(pieces), the [start, end) span each piece's rendering takes in it), merged where they
    touch; `render` takes the pieces in order (see the module docstring), which the template may write in
    another order: they are located in the order it writes them."""
    real = render(list(pieces))
    if not pieces:
        return real, []
    n = len(pieces)
    ph = _placeholders(n, [*pieces, real])
    inert = render(list(ph))
    at = [inert.find(p) for p in ph]
    if min(at) >= 0 and at != sorted(at):  # the template writes them in another order (an agent's tools before its messages)
        order, draw = sorted(range(n), key=at.__getitem__), render
        pieces, ph = [pieces[i] for i in order], [ph[i] for i in order]

        def render(values: list[str]) -> str:
            out: list = [None] * n
            for j, i in enumerate(order):
                out[i] = values[j]
            return draw(out)
    renders = [inert] + [render([*pieces[:i], *ph[i:]]) for i in range(1, n)] + [real]
    spans = []
    for i in range(n):
        t, u = renders[i], renders[i + 1]
        start = t.find(ph[i])
        if start < 0 or t.count(ph[i]) != 1 or not real.startswith(t[:start]):
            return real, _around(renders[0], real, ph)
        after = start + len(ph[i])
        nxt = t.find(ph[i + 1], after) if i + 1 < n else len(t)
        if nxt < 0:
            return real, _around(renders[0], real, ph)
        skel = t[after:nxt]  # what the template writes after the piece, up to the next (or the end)
        at = u.find(ph[i + 1]) if i + 1 < n else len(u)
        end = at - len(skel)
        if at < 0 or end < start or u[end:at] != skel:
            return real, _around(renders[0], real, ph)
        spans.append([start, end])
    return real, merged(spans)


def _around(inert: str, real: str, ph: list[str]) -> list[list[int]]:
    """One span from where the inert rendering first differs from the real one to where it last does,
    within the placeholders' reach: the template's text around the pieces depends on them."""
    first = inert.find(ph[0])
    last = inert.rfind(ph[-1])
    first = len(inert) if first < 0 else first
    last = 0 if last < 0 else last + len(ph[-1])
    head = 0
    while head < min(first, len(real)) and inert[head] == real[head]:
        head += 1
    tail = 0
    while tail < min(len(inert) - last, len(real) - head) and inert[-1 - tail] == real[-1 - tail]:
        tail += 1
    return [[head, len(real) - tail]] if len(real) - tail > head else []


def merged(spans: list[list[int]]) -> list[list[int]]:
    out: list[list[int]] = []
    for s, e in sorted(spans):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def shifted(spans: list[list[int]], by: int, within: int) -> list[list[int]]:
    """Spans moved by `by` and clipped to [0, within)."""
    return merged([[max(0, s + by), min(within, e + by)] for s, e in spans])


_PLAIN: OrderedDict[int, tuple[Any, Any]] = OrderedDict()
_CUT = "\ue000grpo-cut\ue000"
"""A token added to the plain copy only (private-use characters), put before a text that follows a token."""
_LOCK = threading.Lock()


class Tokens:
    """A tokenizer's ids of a text some spans of which are outside text (see the module docstring)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        added = tokenizer.added_tokens_decoder
        self.control = {i for i, t in added.items() if t.special or _MARKER.search(t.content)}
        self._content = {i: added[i].content for i in self.control}
        contents = sorted(self._content.values(), key=len, reverse=True)
        self._find = re.compile("|".join(map(re.escape, contents))) if contents else None

    def marked(self, text: str) -> bool:
        """Whether `text` holds a control token's text."""
        return self._find is not None and self._find.search(text) is not None

    def encode(self, text: str, spans: list[list[int]] | None = None) -> list[int]:
        if not spans:
            return self._ids(text)
        cuts = []  # (start, end, id) of the control tokens in the template's own text
        prev = 0
        for s, e in [*spans, [len(text), len(text)]]:
            if s > prev:
                cuts += [(prev + a, prev + b, i) for a, b, i in self._markers(text[prev:s])]
            prev = e
        ids, at = [], 0
        for a, b, i in cuts:
            if a > at:
                ids += self.plain(text[at:a], at > 0)
            ids.append(i)
            at = b
        if at < len(text):
            ids += self.plain(text[at:], at > 0)
        return ids

    def _markers(self, glue: str) -> list[tuple[int, int, int]]:
        """(start, end, id) of the control tokens the tokenizer matches in the template's own text."""
        if getattr(self.tok, "is_fast", False):
            enc = self.tok(glue, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
            # a token matched in the text (not an unknown character the model maps to `<unk>`, a special token too)
            return [(a, b, i) for i, (a, b) in zip(enc["input_ids"], enc["offset_mapping"])
                    if i in self.control and self._content[i] in glue[a:b]]
        if self._find is None:
            return []
        return [(m.start(), m.end(), self.tok.convert_tokens_to_ids(m.group(0))) for m in self._find.finditer(glue)]

    def _ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False, verbose=False)["input_ids"])

    def plain(self, text: str, after_token: bool = False) -> list[int]:
        """`text`'s ids with no control token matched in it (a marker there is its text's tokens; one
        a normalizer would make, such as NFKC's from full-width letters, too). `after_token`: the text
        follows a token in the whole, as the tokenizer sees it there (a Metaspace pre-tokenizer adds
        its `▁` only at the start of the whole text)."""
        backend = getattr(self.tok, "backend_tokenizer", None)
        if backend is None:  # a slow tokenizer: its own switch, for its special tokens
            return list(self.tok(text, add_special_tokens=False, split_special_tokens=True, verbose=False)["input_ids"])
        plain, cut = _plain_backend(backend, self.control)
        if not after_token:
            return list(plain.encode(text, add_special_tokens=False).ids)
        ids = plain.encode(_CUT + text, add_special_tokens=False).ids
        assert ids[0] == cut, "the cut token is matched first"
        return list(ids[1:])


def _plain_backend(backend, control: set[int]):
    """A copy of the fast tokenizer whose control tokens are all special and not matched in text
    (`encode_special_tokens`: transformers' `split_special_tokens`, extended to the marker-shaped
    added tokens that are not special), cached per tokenizer."""
    from tokenizers import AddedToken, Tokenizer

    key = id(backend)
    with _LOCK:
        hit = _PLAIN.get(key)
        if hit is not None and hit[0] is backend:
            return hit[1]
    spec = json.loads(backend.to_str())
    for t in spec.get("added_tokens", []):
        if t["id"] in control:
            t["special"] = True
    plain = Tokenizer.from_str(json.dumps(spec))
    plain.encode_special_tokens = True
    plain.add_tokens([AddedToken(_CUT, special=False, normalized=False)])  # matched still: a token to follow
    made = (plain, plain.token_to_id(_CUT))
    with _LOCK:
        _PLAIN[key] = (backend, made)
        while len(_PLAIN) > 4:
            _PLAIN.popitem(last=False)
    return made
