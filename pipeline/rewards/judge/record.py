"""The judge's ledger: every answer by request hash, so that no request is paid for twice.

While a score (or eval) stage runs, each new answer is written at once, atomically, to
`iter-K/score/judge-cache/<request hash>.json` (iter-K/eval/...) (through the run store: a local disk or an object
store); a score stage killed halfway finds them there and asks only the rest. When the stage's
manifest is written the cache is removed: by then every verdict is in the score parts (the
`extra_<reward>_*` columns), hashed into the manifest. A replay's score stage also knows the
answers stored in its source iteration's score parts, so an unchanged judge is not asked again.
A known answer is reused only when the server reports that it serves the same model as when it
answered (`server`: its /models entry: name, weights, ...): another model behind the same name
is asked again.

What a part records (FIELDS, and the counts RECORDED in its metadata) depends on the answers
only, so that an uninterrupted, a resumed and a Ray run of a judged config write identical parts;
what differs between them (calls made, answers reused from the cache or a replay, retries,
latency, tokens paid for) goes to a stats file beside the cache (`judge-cache/stats-<rows>.json`),
summed into the manifest's `judge` field with the parts' counts when the manifest is written.

Outside a stage (tests, a direct call) the ledger lives in memory only.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
from collections import Counter
from typing import Any

from pipeline.rewards.judge.client import request_hash
from pipeline.store.faults import fault_point

CACHE_DIR = "judge-cache"
STATS = "stats-"
FIELDS = ("answer", "finish_reason", "reason", "request_hash", "request", "prompt_tokens", "completion_tokens",
          "server_model", "server")
"""The record of one verdict, stored as score-part columns `extra_<reward>_<field>`: the answer's facts only."""
STORED = ("request", "answer", "finish_reason", "prompt_tokens", "completion_tokens", "server_model", "server",
          "latency_s", "attempts")
"""What the cache keeps of an answer (value and reason are read from the answer each time)."""
RECORDED = ("requests", "failures", "unreadable")
"""The counts a part's metadata holds (with the reasons): they follow from its answers. The other
counts (calls, reused, from_cache, from_replay, retries, latency_s, tokens) go to the stats file."""


class Ledger:
    """Known answers (request hash -> record) and the counts of this scoring."""

    def __init__(self, store=None, cache_rel: str | None = None, prior: dict[str, dict] | None = None, stage: str = "score"):
        self.store, self.cache_rel, self.stage = store, cache_rel, stage
        self.known: dict[str, dict] = {h: {**r, "source": "replay"} for h, r in (prior or {}).items()}
        self.new = 0
        if store is not None and cache_rel is not None:
            for name in store.listdir(cache_rel):
                h = name.removesuffix(".json")
                if name.endswith(".json") and len(h) == 64:
                    rec = json.loads(store.read_bytes(f"{cache_rel}/{name}"))
                    if request_hash(rec.get("request", "")) == h:  # a record that is not its request's is not used
                        self.known[h] = {**rec, "source": "cache"}
        self.stats: dict[str, Counter] = {}

    def get(self, h: str, server: str | None = None) -> dict | None:
        """The known answer to request `h` from a server that reports serving `server` (None: it reports nothing)."""
        rec = self.known.get(h)
        return rec if rec is not None and rec.get("server") == server else None

    def put(self, h: str, record: dict) -> None:
        """A new answer: kept, and written to the cache before anything else happens."""
        rec = {k: record.get(k) for k in STORED}
        if self.store is not None and self.cache_rel is not None:
            self.store.write_bytes(f"{self.cache_rel}/{h}.json", json.dumps(rec, sort_keys=True).encode())
        self.known[h] = {**rec, "source": "cache"}
        self.new += 1
        fault_point(f"{self.stage}:verdict", self.new)  # resume tests: GRPO_FAULT=score:verdict:N dies after the N-th answer

    def count(self, column: str, **amounts: float) -> None:
        c = self.stats.setdefault(column, Counter())
        for k, v in amounts.items():
            c[k] += v or 0

    def summary(self, part: str = "all") -> dict[str, dict[str, Any]]:
        """{reward column: {requests, calls, reused, from_cache, from_replay, retries, failures, unreadable,
        latency_s, prompt_tokens, completion_tokens, reasons: {reason: n}}} of this scoring;
        part "recorded": the RECORDED counts and reasons only, "volatile": the others."""
        out = {}
        for column, c in sorted(self.stats.items()):
            d = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in sorted(c.items())
                 if not k.startswith("reason:") and (part == "all" or (k in RECORDED) == (part == "recorded"))}
            if part != "volatile":
                d["reasons"] = {k[7:]: v for k, v in sorted(c.items()) if k.startswith("reason:")}
            out[column] = d
        return out

    def save_stats(self, rows: str) -> None:
        """The volatile counts of scoring `rows` (a part's rows: the same name for every attempt at it,
        so the last attempt's stand), beside the cache; `stage_stats` adds them up."""
        if self.store is not None and self.cache_rel is not None and self.stats:
            self.store.write_bytes(f"{self.cache_rel}/{STATS}{rows}.json", json.dumps(self.summary("volatile"), sort_keys=True).encode())


_CURRENT: contextvars.ContextVar[Ledger | None] = contextvars.ContextVar("grpo_judge_ledger", default=None)


@contextlib.contextmanager
def recording(ledger: Ledger):
    """Judges called inside use `ledger` (the score stage's); outside, a fresh in-memory one."""
    token = _CURRENT.set(ledger)
    try:
        yield ledger
    finally:
        _CURRENT.reset(token)


def current() -> Ledger:
    return _CURRENT.get() or Ledger()


def merge_summaries(parts: list[dict]) -> dict[str, dict]:
    """The stage's judge summary: the parts' summaries added up."""
    out: dict[str, dict] = {}
    for summary in parts:
        for column, d in summary.items():
            acc = out.setdefault(column, {"reasons": {}})
            for k, v in d.items():
                if k == "reasons":
                    for reason, n in v.items():
                        acc["reasons"][reason] = acc["reasons"].get(reason, 0) + n
                else:
                    acc[k] = round(acc.get(k, 0) + v, 6)
    return out


def stage_stats(store, cache_rel: str) -> list[dict]:
    """The volatile counts of every part scored in a stage (its stats files; [] when there are none)."""
    return [json.loads(store.read_bytes(f"{cache_rel}/{name}")) for name in sorted(store.listdir(cache_rel))
            if name.startswith(STATS) and name.endswith(".json")]


def stored_records(tables: list) -> dict[str, dict]:
    """Request hash -> record of every verdict stored in score parts (pyarrow tables)."""
    out: dict[str, dict] = {}
    for t in tables:
        names = t.column_names
        for col in names:
            if not (col.startswith("extra_") and col.endswith("_request_hash")):
                continue
            base = col[: -len("request_hash")]
            cols = {f: t.column(base + f).to_pylist() for f in STORED if base + f in names}
            for i, h in enumerate(t.column(col).to_pylist()):
                rec = {f: v[i] for f, v in cols.items()}
                if h and h not in out and rec.get("answer") is not None and request_hash(rec.get("request") or "") == h:
                    out[h] = rec
    return out


def summary_lines(summary: dict | None) -> list[str]:
    """One line per judge of a score manifest's `judge` summary, for people."""
    lines = []
    for column, d in sorted((summary or {}).items()):
        reasons = ", ".join(f"{n} {r}" for r, n in sorted(d.get("reasons", {}).items()))
        lines.append(f"judge {column!r}: {d.get('requests', 0):g} verdicts, {d.get('calls', 0):g} calls made, "
                     f"{d.get('reused', 0):g} reused, {d.get('retries', 0):g} retries, {d.get('failures', 0):g} failed, "
                     f"{d.get('unreadable', 0):g} unreadable" + (f" ({reasons})" if reasons else ""))
    return lines
