"""`grpo audit`'s check of the served rewards' answers (a judge's verdicts, a served reward model's
logits, an OpenRLHF server's rewards) in the score and eval parts: each completion's stored request
hashes to its `request_hash`, and its stored answer, read as the configured reward reads it, gives the
stored reward and reason (and an OpenRLHF server's extra_logs, the stored `extra_<name>` columns). An answer, a request or a reward edited after the fact (even with the
manifest's sha256 rewritten to match) shows as the row and what disagrees.
"""

from __future__ import annotations

import io
import math

import pyarrow.parquet as pq

from pipeline.report.audit_record import Auditor
from pipeline.rewards.judge import asker_of
from pipeline.rewards.judge.client import request_hash
from pipeline.rewards.judge.record import FIELDS
from schemas.artifacts import EXTRA_PREFIX, REWARD_PREFIX


def check_verdicts(a: Auditor, sd: str, m) -> None:
    """Every served reward of score or eval manifest `m` (in stage dir `sd`), every listed part."""
    from pipeline.config.rewards import validate_reward

    judges = [spec for spec in (validate_reward(r, stored=True) for r in m.rewards or []) if spec.served]
    if not judges:
        return
    for name in sorted(m.outputs):
        rel = f"{sd}/{name}"
        if not a.store.exists(rel):
            continue  # reported by the part check
        try:
            table = pq.read_table(io.BytesIO(a.store.read_bytes(rel)))
        except Exception:  # noqa: BLE001, S112 (a torn part: reported by the part check)
            continue
        for spec in judges:
            _check_judge(a, rel, table, spec)


def _check_judge(a: Auditor, rel: str, table, spec) -> None:
    col = spec.column
    base = f"{EXTRA_PREFIX}{col}_"
    need = [REWARD_PREFIX + col, base + "answer", base + "reason", base + "request", base + "request_hash"]
    missing = [c for c in need if c not in table.column_names]
    if missing:
        a.audit.problem(rel, f"judge {col!r}: no column {missing[0]!r} (its verdicts are not recorded)")
        return
    rewards, answers, reasons, requests, hashes = (table.column(c).to_pylist() for c in need)
    finish = base + "finish_reason"  # a judge's answer cut off reads as none (absent from older parts)
    finished = table.column(finish).to_pylist() if finish in table.column_names else [None] * len(answers)
    for i, (reward, answer, reason, request, h) in enumerate(zip(rewards, answers, reasons, requests, hashes)):
        where = f"judge {col!r} row {i}"
        if request is None or request_hash(request) != h:
            a.audit.problem(rel, f"{where}: the stored request does not hash to its request_hash")
            return
        if answer is None:  # a failed request (on_failure: none)
            value, why = None, reason if (reason or "").startswith("failed: ") else "no answer"
        else:
            value, why = asker_of(spec.kwargs).read(answer, finished[i])
        stored = None if reward is None or (isinstance(reward, float) and math.isnan(reward)) else reward
        if why != reason or (value is None) != (stored is None) or (value is not None and value != stored):
            a.audit.problem(rel, f"{where}: the stored answer reads as {value!r} ({why or 'readable'}), "
                                 f"the part records reward {stored!r} ({reason or 'readable'})")
            return
    asker = asker_of(spec.kwargs)
    if hasattr(asker, "logs"):  # an OpenRLHF server's extra_logs: each column as the stored answers give it
        _check_logs(a, rel, table, col, [asker.logs(x) for x in answers])


def _check_logs(a: Auditor, rel: str, table, col: str, logged: list[dict]) -> None:
    from pipeline.score import extra_column

    for name in sorted({k for d in logged for k in d}):
        # a name another reward logged first lands in the reward's own column (RewardLog.extra_logger: serve_rm
        # logs `dummy_scores` whatever it serves, so two of its servers always do)
        renamed = f"{EXTRA_PREFIX}{col}_{name}"
        column = renamed if renamed in table.column_names and name not in FIELDS else EXTRA_PREFIX + name
        if column not in table.column_names:
            a.audit.problem(rel, f"judge {col!r}: no column {column!r} (its answers' extra_logs are not recorded)")
            continue
        want = extra_column([d.get(name) for d in logged]).to_pylist()
        for i, (w, g) in enumerate(zip(want, table.column(column).to_pylist())):
            if not (w == g or (isinstance(w, float) and isinstance(g, float) and math.isnan(w) and math.isnan(g))):
                a.audit.problem(rel, f"judge {col!r} row {i}: the stored answer's extra_logs give {name} = {w!r}, "
                                     f"the part records {column} = {g!r}")
                break
