"""The tokens route, `POST /inference/v1/generate` (server.py), in the shape verifiers' train client
(its `renderers` package, renderers/client.py `generate`) sends and reads: the client renders the
conversation to token ids itself and sends `{model, token_ids, sampling_params}`; the answer is
`{request_id, choices: [{index, token_ids, logprobs: {content: [{token: "token_id:N", logprob}]},
finish_reason}], usage}` (with `prompt_token_ids` when the body asks `return_token_ids`).

The runner (runner.EndpointRunner) hands such requests here. The first turn's token_ids are the
episode's prompt, as the client rendered them (grpo renders nothing on this route). Each later turn's
token_ids must begin with the episode's recorded ids exactly (that prompt, every sampled id, every
glue id before); what follows is the client's glue (its template's end of turn, tool results, a user
message), appended under mask 0. Any other ids end the episode (history_rewritten, the first token
that differs in `detail`): nothing is ever re-tokenised. Sampling is the run's, the client's
`sampling_params` recorded beside it (`asked`). A request for another model is a side call, sampled
from its own ids and never in the row.

A request's record entry is a chat turn's (runner.py) with `"route": "tokens"` and no
`new_messages`; `message` is the sampled ids' text ({role: assistant, content}). The record's
`messages` hold each turn ({role: assistant, content, text, tokens, finish_reason}) and each glue
({role: context, content: its text, tokens}).
"""

from __future__ import annotations

from pipeline.agents.endpoint import chat
from pipeline.agents.endpoint.jobs import MODEL, SIDE_SEED, Job, again, other_route, side_refused, stops_unserved
from pipeline.data.prompts import derive_seed

ROUTE = "tokens"
ASKED = ("model", "sampling_params", "cache_salt", "priority", "return_token_ids", "request_id")
"""The body's fields recorded as it sent them (`asked`): what it asked for, beside what grpo used."""
UNSERVED = ("features", "content_parts", "multi_modal_data")
"""Multimodal inputs (images): refused as malformed, grpo's engine samples text alone."""


def check_body(body, secret: str, vocab: int) -> None:
    """chat.BadBody naming what is wrong, unless `body` is a tokens request grpo serves (one choice, text ids)."""
    chat.check_secret(body, secret)  # first: the messages below quote the body's values (a `stop` or `n` that is the key)
    if not isinstance(body, dict):
        raise chat.BadBody("the body is not a JSON object")
    if not isinstance(body.get("model"), str):
        raise chat.BadBody("`model` must be a string")
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(type(t) is int and 0 <= t < vocab for t in ids):
        raise chat.BadBody(f"`token_ids` must be a non-empty list of token ids (integers from 0 to {vocab - 1})")
    sp = body.get("sampling_params", {})
    if not isinstance(sp, dict):
        raise chat.BadBody("`sampling_params` must be an object")
    chat.check_stop(sp.get("stop"), "sampling_params.stop")
    chat.check_ids(sp.get("stop_token_ids"), "sampling_params.stop_token_ids")
    if sp.get("n", 1) != 1:
        raise chat.BadBody(f"sampling_params.n={sp.get('n')!r}: grpo's endpoint samples one choice per request (n=1)")
    if any(k in body for k in UNSERVED):
        raise chat.BadBody(f"{', '.join(k for k in UNSERVED if k in body)}: grpo's tokens route takes text token ids only")
    if body.get("stream"):
        raise chat.BadBody("`stream`: the tokens route answers in one piece")
    chat.check_text(body)


def check_decoded(tok, ids: list[int], secret: str) -> None:
    """chat.BadBody when `ids` decode to text holding `secret` (the episode's key), special tokens kept or skipped
    (a key split by one): the record keeps the ids and their text, as the chat route keeps a body's (chat.check_secret)."""
    try:
        chat.check_secret([tok.decode(ids), tok.decode(ids, skip_special_tokens=True)], secret)
    except chat.BadBody:
        raise chat.BadBody("`token_ids` decode to text holding the episode's API key (OPENAI_API_KEY), which is never recorded") from None


def request(runner, e, r) -> Job | None:
    """runner._request for a tokens body: a Job for the engine, or None when answered without one
    (refused, malformed, a retry)."""
    body = r.body
    try:
        if body is not None:
            check_body(body, e.key, len(runner.tok))
            check_decoded(runner.tok, body["token_ids"], e.key)  # the prompt's ids or the glue: recorded, so never the key
    except chat.BadBody as err:
        return runner._malformed(e, r, None, err)
    h = r.digest
    if again(e, r):  # a client's retry: the answer it had, nothing recorded (as the chat route)
        return None
    if e.ending is not None:
        runner._refuse(e, r, h, f"the episode has ended ({e.ending})")
        return None
    if body is None:
        return runner._malformed(e, r, h, chat.BadBody(r.raw_error))
    ids, sp = list(body["token_ids"]), body.get("sampling_params") or {}
    entry = {"route": ROUTE, "body_sha256": h, "asked": {k: body[k] for k in ASKED if k in body}}
    unserved = stops_unserved(runner, sp.get("stop"), sp.get("stop_token_ids"), "sampling_params.")
    if body["model"] != MODEL:
        if (why := unserved or side_refused(runner, e, len(ids))) is not None:
            runner._refuse(e, r, h, why, "side_refused")
            return None
        e.sides += 1
        seed, cap = derive_seed(e.seed, e.sample_idx, e.turns, SIDE_SEED, e.sides), runner.cfg.max_new_tokens
        return Job(e, r, "side", ids, seed, cap, {"kind": "side", **entry, "seed": seed, "sampling": runner.sampling(cap), "prompt_ids": ids})
    if (why := other_route(e, r) or unserved) is not None:  # one route per episode; the engine's stops alone
        return runner._over(e, r, h, "unsupported_request", why)
    if not e.prompt_ids:
        if len(ids) > runner.max_prompt_len:
            e.end("prompt_too_long", f"{len(ids)} tokens, more than the {runner.max_prompt_len} the context leaves beside "
                                     f"rollout.max_episode_tokens ({runner.budget})")
            runner._refuse(e, r, h, e.detail)
            return None
        e.prompt_ids, e.prompt_text = ids, runner.tok.decode(ids)
        entry["prompt_tokens"] = len(ids)
    else:
        have = e.prompt_ids + e.ids
        if (why := extension_problem(have, ids, len(e.prompt_ids))) is not None:
            return runner._over(e, r, h, "history_rewritten", why, f"the token ids do not extend the episode's record: {why}")
        if runner.cfg.max_turns is not None and e.turns >= runner.cfg.max_turns:
            return runner._over(e, r, h, "max_turns", None, f"the episode has ended (max_turns {runner.cfg.max_turns})")
        glue = ids[len(have):]
        if len(e.ids) + len(glue) >= runner.budget:  # no room for a token of the next turn
            return runner._over(e, r, h, "max_episode_tokens", None, f"the episode has ended (rollout.max_episode_tokens {runner.budget})")
        text = runner.tok.decode(glue)
        e.extend(glue, None, text)
        if glue:
            e.messages.append({"role": "context", "content": text, "tokens": len(glue)})
        entry["prompt_delta"] = glue
    cap = min(runner.cfg.max_new_tokens, runner.budget - len(e.ids))
    seed = derive_seed(e.seed, e.sample_idx, e.turns)
    return Job(e, r, "turn", e.prompt_ids + e.ids, seed, cap, {"kind": "turn", **entry, "seed": seed, "sampling": runner.sampling(cap)})


def extension_problem(have: list[int], ids: list[int], prompt_len: int) -> str | None:
    """Why `ids` does not begin with the recorded `have` (the prompt's `prompt_len` ids, then the
    episode's sampled and glue ids), or None."""
    for i, (a, b) in enumerate(zip(have, ids)):
        if a != b:
            where = f"prompt token {i}" if i < prompt_len else f"completion token {i - prompt_len}"
            return f"token_ids[{i}] is {b}, the record's {where} is {a}"
    if len(ids) < len(have):
        return f"it has {len(ids)} token ids, fewer than the {len(have)} recorded (prompt, sampled and glue ids)"
    return None


def answer(runner, j, s) -> None:
    """runner._answer for a tokens job `j` sampled as `s` (an engine Sample)."""
    e, ids, lps = j.e, list(s.token_ids), list(s.logprobs)
    msg = {"role": "assistant", "content": s.text}
    j.entry.update(completion_ids=ids, logprobs=lps, finish_reason=s.finish_reason, message=msg)
    e.requests.append(j.entry)
    payload = completion(j.r.body, f"generate-{e.group_idx}-{e.sample_idx}-{len(e.requests)}", j.prompt, ids, lps, s.finish_reason)
    if j.kind == "turn":
        e.extend(ids, lps, s.text)
        e.turns, e.finish_reason, e.last_ids = e.turns + 1, s.finish_reason, ids
        e.messages.append({"role": "assistant", "content": s.text, "text": s.text, "tokens": len(ids), "finish_reason": s.finish_reason})
        e.last = (j.entry["body_sha256"], 200, payload, None)
        if s.finish_reason == "length":
            e.end("max_episode_tokens" if j.cap < runner.cfg.max_new_tokens else "length")
    else:
        e.side_answers[j.entry["body_sha256"]] = (200, payload, None)
    j.r.answer(200, payload)


def completion(body: dict, rid: str, prompt: list[int], ids: list[int], logprobs: list[float], finish: str) -> dict:
    """The answer as verifiers' train client reads it: each sampled id with its logprob, the token
    written `token_id:N` (renderers/client.py `_parse_completion_logprobs`); logprobs when asked, a
    logprob JSON cannot hold (-inf) written as vLLM writes it (-9999.0, which that client refuses)."""
    content = [{"token": f"token_id:{t}", "logprob": max(lp, -9999.0), "top_logprobs": []} for t, lp in zip(ids, logprobs)]
    choice = {"index": 0, "token_ids": ids, "finish_reason": finish,
              "logprobs": {"content": content} if (body.get("sampling_params") or {}).get("logprobs") is not None else None}
    out = {"request_id": rid, "choices": [choice],
           "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)}}
    if body.get("return_token_ids"):
        out["prompt_token_ids"] = prompt
    return out


def row_problems(runner, row: dict, rec: dict, seed: int | None = None) -> list[str]:
    """audit.row_problems for a tokens-route row: its ids, mask and logprobs are its recorded turns'
    completion ids (mask 1, their logprobs) after their glue (mask 0), at the row's places, each
    turn's seed and cap the ones the run derives (`seed`: the group's; None leaves seeds unchecked)."""
    turns = [q for q in rec["requests"] if q["kind"] == "turn"]
    said = [m for m in rec["messages"] if m["role"] == "assistant"]
    if len(said) != len(turns) or rec["turns"] != len(turns) or not turns:
        return [f"its record holds {len(turns)} turn request(s), {len(said)} assistant message(s) and turns {rec['turns']}"]
    if turns[0].get("prompt_tokens") != len(row["prompt_ids"]):
        return [f"prompt_ids are not its first request's {turns[0].get('prompt_tokens')} token ids"]
    ids, mask, lps = list(row["completion_ids"]), list(row["completion_mask"] or []), []
    want_mask: list[int] = []
    for j, (q, m) in enumerate(zip(turns, said)):
        glue = q.get("prompt_delta", []) if j else []
        at = len(want_mask)
        if ids[at:at + len(glue)] != glue:
            return [f"completion_ids at token {at} are not the glue turn {j + 1}'s request sent"]
        want_mask += [0] * len(glue)
        lps += [0.0] * len(glue)
        at = len(want_mask)
        cap = min(runner.cfg.max_new_tokens, runner.budget - at)
        if (seed is not None and derive_seed(seed, row["sample_idx"], j) != q["seed"]) or q["sampling"]["max_tokens"] != cap:
            return [f"turn {j + 1}: its recorded seed or token cap is not the one the run derives"]
        if ids[at:at + len(q["completion_ids"])] != q["completion_ids"] or m["tokens"] != len(q["completion_ids"]):
            return [f"completion_ids at token {at} are not turn {j + 1}'s recorded completion ids"]
        if m["text"] != q["message"]["content"]:
            return [f"turn {j + 1}: its recorded answer is not its assistant message"]
        want_mask += [1] * len(q["completion_ids"])
        lps += list(q["logprobs"])
    if len(ids) != len(want_mask) or mask != want_mask:
        return [f"its ids and mask are not its {len(turns)} recorded turn(s) and their glue (mask 1 on the sampled ids alone)"]
    if "sampler_logprobs" in row and list(row["sampler_logprobs"]) != lps:
        return ["sampler_logprobs are not its turns' recorded logprobs (0 on the glue)"]
    return []
