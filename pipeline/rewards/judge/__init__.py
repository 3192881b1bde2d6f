"""Served rewards: `judge`, a built-in reward asking an LLM behind any OpenAI-compatible chat
endpoint (vLLM's server, SGLang, hosted APIs) to grade each completion on a rubric, and a served
`reward_model` (served_model.py: a classifier behind vLLM's pooling server); every answer recorded.

For each completion the judge's rubric (options.py) is filled in with the prompt, the completion
(for an episode: the model's own turns) and the row's dataset columns, sent as one chat request
(client.py), and the answer read into a number (verdict.py); a served reward model is sent the
text the in-process `reward_model` scores and its logits are read as in-process. Both go through
`served_rewards`: requests run concurrently, at most `max_concurrency` in flight; a 429, a 5xx, a
timeout or a lost connection is retried `retries` times with exponential backoff. An answer that
cannot be read gives None for that completion (left out of the total, as any reward's None) and
its reason is counted. A request that fails after its retries stops the stage with one line
(`on_failure: error`, the default; every answer obtained so far is kept for the next attempt), or
gives None (`on_failure: none`).

Every request is keyed by the sha256 of its canonical JSON (the judge's: model, messages, sampling
settings; the reward model's: model, text, truncation; not the URL, not the key): a request whose
answer is known (record.py: this stage's cache, a replay's source) is not sent again. Each
completion's record lands in the stage's part as `extra_<reward>_<field>` columns (record.FIELDS)
and the counts in the part's metadata.
"""

from __future__ import annotations

import asyncio

from pipeline.errors import GRPOError
from pipeline.rewards.judge.chat import ChatJudge, completion_text, prompt_text, render  # noqa: F401 (the package's names)
from pipeline.rewards.judge.client import JudgeFailure, ask, headers, request_hash
from pipeline.rewards.judge.record import FIELDS, Ledger, current


def served_rewards(spec, prompts: list, completions: list, columns: dict[str, list], log, where: str,
                   ledger: Ledger | None = None) -> list[float | None]:
    """Rewards of `spec` (a `judge` entry of `rewards:`, or a served `reward_model`) for N
    completions; the records go to `log` as extra columns, the counts to the ledger (the stage's,
    or a fresh one)."""
    o = spec.kwargs
    asker = o.asker()  # ChatJudge, or served_model.ServedClassifier
    ledger = ledger or current()
    n = len(completions)
    bodies = asker.bodies(prompts, completions, columns, where)
    hashes = [request_hash(b) for b in bodies]
    records: list[dict | None] = [None] * n
    todo: dict[str, list[int]] = {}  # one request per distinct body, however many rows share it
    for i, h in enumerate(hashes):
        if (known := ledger.get(h)) is not None:
            records[i] = {**known, "reused": True}
        else:
            todo.setdefault(h, []).append(i)
    failures = _ask_all(spec, asker, {h: bodies[rows[0]] for h, rows in todo.items()}, ledger)
    for h, rows in todo.items():
        rec = ledger.get(h) or {"request": bodies[rows[0]], "answer": None, "source": "call",
                                "attempts": failures[h].attempts, "failure": str(failures[h])}
        for r, i in enumerate(rows):
            records[i] = {**rec, "source": "call", "reused": r > 0}
    out: list[float | None] = []
    col = spec.column
    for i, rec in enumerate(records):
        if rec["answer"] is None:
            value, reason = None, f"failed: {rec['failure']}"
        else:
            value, reason = asker.read(rec["answer"])
        out.append(value)
        rec.update(reason=reason, request_hash=hashes[i])
        called = not rec.get("reused")
        ledger.count(col, requests=1, reused=int(not called), calls=int(called and rec["answer"] is not None),
                     failures=int(rec["answer"] is None), unreadable=int(reason is not None and rec["answer"] is not None),
                     retries=(rec.get("attempts") or 1) - 1 if called else 0,
                     latency_s=rec.get("latency_s") if called else 0, prompt_tokens=rec.get("prompt_tokens") if called else 0,
                     completion_tokens=rec.get("completion_tokens") if called else 0)
        if reason is not None:
            ledger.count(col, **{f"reason:{reason.split(' (')[0]}": 1})
    log_extra = log.extra_logger(where, range(n))
    for field in FIELDS:
        log_extra(f"{col}_{field}", [rec.get(field) for rec in records])
    return out


def _ask_all(spec, asker, bodies: dict[str, str], ledger: Ledger) -> dict[str, JudgeFailure]:
    """Send every body (hash -> body), at most spec.max_concurrency at once; each answer goes into
    the ledger as it arrives. Returns the failures (on_failure: none), or raises the first."""
    if not bodies:
        return {}
    import httpx

    async def main() -> dict[str, JudgeFailure]:
        sem = asyncio.Semaphore(spec.max_concurrency)
        url, hdrs = asker.url, headers(asker.o)
        limits = httpx.Limits(max_connections=spec.max_concurrency, max_keepalive_connections=spec.max_concurrency)
        async with httpx.AsyncClient(limits=limits) as client:

            async def one(h: str, body: str):
                async with sem:
                    answer = await ask(client, url, body, hdrs, spec.timeout_s, spec.retries, asker.parse, asker.kind)
                ledger.put(h, {"request": body, "answer": answer.text or "", "latency_s": round(answer.latency_s, 6),
                               "prompt_tokens": answer.prompt_tokens, "completion_tokens": answer.completion_tokens,
                               "server_model": answer.server_model, "attempts": answer.attempts})

            keys = list(bodies)
            results = await asyncio.gather(*(one(h, bodies[h]) for h in keys), return_exceptions=True)
        failed = {}
        for h, res in zip(keys, results):
            if isinstance(res, BaseException) and not isinstance(res, JudgeFailure):
                raise res
            if isinstance(res, JudgeFailure):
                failed[h] = res
        return failed

    failed = asyncio.run(main())
    stop = {h: f for h, f in failed.items() if asker.o.on_failure == "error" or not f.retryable}
    if stop:
        first = next(iter(stop.values()))
        kept = len(bodies) - len(failed)
        raise GRPOError(f"{asker.what}: {len(failed)} of {len(bodies)} requests failed "
                        f"(first: {first}); the {kept} answered are kept for the next attempt")
    return failed
