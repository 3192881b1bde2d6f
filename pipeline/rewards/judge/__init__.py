"""Served rewards: `judge`, a built-in reward asking an LLM behind any OpenAI-compatible chat
endpoint (vLLM's server, SGLang, hosted APIs) to grade each completion on a rubric, and a served
`reward_model` (served_model.py: a classifier behind vLLM's pooling server); every answer recorded.

For each completion the judge's rubric (options.py) is filled in with the prompt, the completion
(for an episode: the model's own turns) and the row's dataset columns, sent as one chat request
(client.py), and the answer read into a number (verdict.py); a served reward model is sent the
text the in-process `reward_model` scores and its logits are read as in-process. Both go through
`served_rewards`: requests run concurrently, at most `max_concurrency` in flight (per scoring
process); a 408, 409, 429, a 5xx, a timeout or a lost connection is retried `retries` times as the
openai client retries (client.py). An answer that cannot be read gives None for that completion
(left out of the total, as any reward's None) and its reason is counted. A request that fails
(after its retries, or at once with another 4xx) stops the stage with one line (`on_failure:
error`, the default; every answer obtained so far is kept for the next attempt), or gives None
(`on_failure: none`); a 401, 403 or 404 (a wrong key, no such model: every request alike) always stops it.

Every request is keyed by the sha256 of its canonical JSON (the judge's: model, messages, sampling
settings; the reward model's: model, text, truncation; not the URL, not the key) and by what the
server reports it serves (its /models entry, asked once per scoring): a request whose answer from
that model is known (record.py: this stage's cache, a replay's source) is not sent again. Each
completion's record lands in the stage's part as `extra_<reward>_<field>` columns (record.FIELDS),
the counts that follow from the answers in the part's metadata, the others in a stats file (record.py).
"""

from __future__ import annotations

import asyncio

from pipeline.config.judge import JudgeOptions
from pipeline.config.rewards import OpenRLHFServerOptions
from pipeline.errors import GRPOError
from pipeline.rewards.judge.chat import ChatJudge, completion_text, prompt_text, render  # noqa: F401 (the package's names)
from pipeline.rewards.judge.client import REFUSED_ALL, JudgeFailure, ask, headers, request_hash, served_identity
from pipeline.rewards.judge.record import FIELDS, Ledger, current
from pipeline.rewards.judge.openrlhf_server import OpenRLHFServer
from pipeline.rewards.judge.served_model import ServedClassifier


def asker_of(options):
    """How a served reward's requests are made and its answers read: a judge's options
    (pipeline.config.judge.JudgeOptions) give a ChatJudge, an `openrlhf_server`'s an OpenRLHFServer,
    a served reward model's a ServedClassifier."""
    if isinstance(options, JudgeOptions):
        return ChatJudge(options)
    return OpenRLHFServer(options) if isinstance(options, OpenRLHFServerOptions) else ServedClassifier(options)


def served_rewards(spec, prompts: list, completions: list, columns: dict[str, list], log, where: str,
                   ledger: Ledger | None = None, rendered: list[str] | None = None) -> list[float | None]:
    """Rewards of `spec` (a `judge` entry of `rewards:`, a served `reward_model`, an `openrlhf_server`)
    for N completions; the records go to `log` as extra columns (with what an answer asks to log:
    an OpenRLHF server's extra_logs), the counts to the ledger (the stage's, or a fresh one).
    `rendered`: the rollout's rendered prompts (OpenRLHF's protocol sends them)."""
    o = spec.kwargs
    asker = asker_of(o)
    ledger = ledger or current()
    n = len(completions)
    bodies = asker.bodies(prompts, completions, columns, where, rendered)
    hashes = [request_hash(b) for b in bodies]
    server, sent, failures = _ask_all(spec, asker, dict(zip(hashes, bodies)), ledger)
    records: list[dict] = []
    logged: list[dict] = []  # what each answer asks to log beside its reward (OpenRLHF's extra_logs)
    out: list[float | None] = []
    seen: set[str] = set()  # one request per distinct body, however many rows share it
    col = spec.column
    for i, h in enumerate(hashes):
        rec = ledger.get(h, server) or {"request": bodies[i], "answer": None, "server": server,
                                        "attempts": failures[h].attempts, "failure": str(failures[h])}
        source = "reused" if h in seen else "call" if h in sent else rec["source"]  # call, reused, cache, replay
        seen.add(h)
        if rec["answer"] is None:
            value, reason = None, f"failed: {rec['failure']}"
        else:
            value, reason = asker.read(rec["answer"], rec.get("finish_reason"))
        out.append(value)
        logged.append(asker.logs(rec["answer"]) if hasattr(asker, "logs") else {})
        records.append({**rec, "reason": reason, "request_hash": h})
        called = source == "call"  # what this scoring paid for: the manifest's, never the part's (record.py)
        ledger.count(col, calls=int(called and rec["answer"] is not None), reused=int(not called),
                     from_cache=int(source == "cache"), from_replay=int(source == "replay"),
                     retries=(rec.get("attempts") or 1) - 1 if called else 0,
                     latency_s=rec.get("latency_s") if called else 0,
                     prompt_tokens=rec.get("prompt_tokens") if called else 0,
                     completion_tokens=rec.get("completion_tokens") if called else 0)
        ledger.count(col, requests=1, failures=int(rec["answer"] is None),  # what the answers say: the part's
                     unreadable=int(reason is not None and rec["answer"] is not None))
        if reason is not None:
            ledger.count(col, **{f"reason:{reason_key(reason)}": 1})
    log_extra = log.extra_logger(where, range(n))
    for field in FIELDS:
        log_extra(f"{col}_{field}", [rec.get(field) for rec in records])
    for name in sorted({k for d in logged for k in d}):
        if name.startswith(f"{col}_") and name.removeprefix(f"{col}_") in FIELDS:
            raise GRPOError(f"{where}: the server's extra_logs name {name!r}, which is this reward's own record; "
                            f"rename the reward (`name:`)")
        log_extra(name, [d.get(name) for d in logged])
    return out


def _ask_all(spec, asker, bodies: dict[str, str], ledger: Ledger) -> tuple[str | None, set[str], dict[str, JudgeFailure]]:
    """Ask the server what it serves, then send every body (hash -> body) whose answer from that
    server is not known, at most spec.max_concurrency at once; each answer goes into the ledger as
    it arrives. Returns what the server serves, the hashes sent and the failures (on_failure: none),
    or raises the first."""
    import httpx

    async def main() -> tuple[str | None, dict[str, str], dict[str, JudgeFailure]]:
        sem = asyncio.Semaphore(spec.max_concurrency)
        url, hdrs = asker.url, headers(asker.o)
        limits = httpx.Limits(max_connections=spec.max_concurrency, max_keepalive_connections=spec.max_concurrency)
        async with httpx.AsyncClient(limits=limits) as client:
            try:  # a server with no model list (OpenRLHF's) is known by its URL
                server = await served_identity(client, asker.o, hdrs, spec.timeout_s, spec.retries) \
                    if getattr(asker, "lists_models", True) else asker.identity
            except JudgeFailure as failure:
                raise GRPOError(f"{asker.what}: its model list (GET /models) failed ({failure}); what the server serves "
                                "is part of each verdict's record, so nothing was asked") from None
            todo = {h: b for h, b in bodies.items() if ledger.get(h, server) is None}
            if not todo:
                return server, todo, {}
            try:  # a served reward model's server: does it answer logits when asked to? (served_model.py)
                await asker.prepare(client, hdrs, spec)
            except JudgeFailure as failure:  # the requests would fail as the check did: not sent
                return server, todo, dict.fromkeys(todo, failure)

            async def one(h: str, body: str):
                async with sem:
                    answer = await ask(client, url, body, hdrs, spec.timeout_s, spec.retries, asker.parse, asker.kind)
                ledger.put(h, {"request": body, "answer": answer.text or "", "finish_reason": answer.finish_reason,
                               "latency_s": round(answer.latency_s, 6), "prompt_tokens": answer.prompt_tokens,
                               "completion_tokens": answer.completion_tokens, "server_model": answer.server_model,
                               "server": server, "attempts": answer.attempts})

            keys = list(todo)
            results = await asyncio.gather(*(one(h, todo[h]) for h in keys), return_exceptions=True)
        failed = {}
        for h, res in zip(keys, results):
            if isinstance(res, BaseException) and not isinstance(res, JudgeFailure):
                raise res
            if isinstance(res, JudgeFailure):
                failed[h] = res
        return server, todo, failed

    server, sent, failed = asyncio.run(main())
    refused = [f for f in failed.values() if f.status in REFUSED_ALL]  # a wrong key would give every row None
    if refused or (failed and asker.o.on_failure == "error"):  # on_failure none: any other failure of a request gives None
        first = refused[0] if refused else next(iter(failed.values()))
        kept = len(sent) - len(failed)
        raise GRPOError(f"{asker.what}: {len(failed)} of {len(sent)} requests failed "
                        f"(first: {first}); the {kept} answered are kept for the next attempt")
    return server, set(sent), failed


def reason_key(reason: str) -> str:
    """A reason as counted: without its details ("failed: HTTP 400: This model's ... (1 attempt)" counts
    as "failed: HTTP 400", "no label 1 (1 logits)" as "no label 1")."""
    return ": ".join(reason.split(" (")[0].split(": ")[:2])
