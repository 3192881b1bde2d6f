"""One request to a served reward over HTTP (httpx): the chat-completions body, its hash, retries
with backoff. `ask` reads any JSON answer through a `parse` function: a chat completion's (here)
for `judge`, a classification's (served_model.py) for a served `reward_model`.

httpx rather than the `openai` client: the status code, the `Retry-After` header, each attempt and
its latency are ours to count and record, where the openai client retries by itself, out of sight
(and it would add nothing else: the request is one POST of a JSON body).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: options.py picks its asker from these modules
    from pipeline.rewards.judge.options import JudgeOptions

BACKOFF_S = 0.5
"""The first retry waits about this long, each further one twice as long (at most MAX_BACKOFF_S)."""
MAX_BACKOFF_S = 20.0


class JudgeFailure(Exception):
    """A request that got no answer after its retries (or one the server refused outright)."""

    def __init__(self, cause: str, attempts: int, retryable: bool = True):
        super().__init__(f"{cause} ({attempts} attempt{'s' if attempts != 1 else ''})")
        self.attempts = attempts
        self.retryable = retryable


@dataclass
class Answer:
    text: str | None
    latency_s: float
    """Seconds of the answered attempt."""
    prompt_tokens: int | None
    completion_tokens: int | None
    server_model: str | None
    attempts: int


def request_body(o: JudgeOptions, user: str) -> str:
    """The chat-completions request, canonical JSON: what is sent, stored and hashed (no key in it)."""
    messages = ([{"role": "system", "content": o.system}] if o.system else []) + [{"role": "user", "content": user}]
    body = {"model": o.model, "messages": messages, "temperature": o.temperature, "max_tokens": o.max_tokens}
    if o.seed is not None:
        body["seed"] = o.seed
    return json.dumps(body, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def request_hash(body: str) -> str:
    """The verdict cache's key: the sha256 of the canonical request (model, messages, sampling)."""
    return hashlib.sha256(body.encode()).hexdigest()


def headers(o) -> dict[str, str]:
    """JSON, and the Bearer key read from `o.api_key_env` (JudgeOptions or a served RewardModelOptions)."""
    out = {"Content-Type": "application/json"}
    if o.api_key_env:
        out["Authorization"] = f"Bearer {os.environ.get(o.api_key_env, '')}"
    return out


def endpoint(o, path: str = "chat/completions") -> str:
    return f"{o.base_url.rstrip('/')}/{path}"


def _backoff(attempt: int, retry_after: str | None) -> float:
    try:
        wait = float(retry_after) if retry_after is not None else None
    except ValueError:
        wait = None
    if wait is None:
        wait = BACKOFF_S * 2**attempt * random.uniform(0.75, 1.25)
    return min(MAX_BACKOFF_S, max(0.0, wait))


def _first_line(text: str) -> str:
    line = (text.strip().splitlines() or [""])[0]
    return line if len(line) <= 120 else line[:117] + "..."


def chat_answer(data: dict) -> Answer:
    """A chat completion's answer (attempts and latency filled in by `ask`); KeyError & co. when it is none."""
    text = data["choices"][0]["message"].get("content")
    usage = data.get("usage") or {}
    return Answer(text=text if isinstance(text, str) else None, latency_s=0.0, prompt_tokens=usage.get("prompt_tokens"),
                  completion_tokens=usage.get("completion_tokens"), server_model=data.get("model"), attempts=0)


async def ask(client, url: str, body: str, hdrs: dict, timeout_s: float, retries: int, parse=chat_answer,
              kind: str = "chat completion") -> Answer:
    """POST `body` until it is answered: 429, 5xx, timeouts and lost connections are retried
    `retries` times with exponential backoff (Retry-After when the server sends one); any other
    status fails at once. An HTTP 200 whose JSON `parse` cannot read (it raises) counts as a
    failed attempt ("not a <kind>"). Raises JudgeFailure."""
    import httpx

    cause = "no attempt"
    for attempt in range(retries + 1):
        retry_after = None
        t0 = time.monotonic()
        try:
            r = await client.post(url, content=body.encode(), headers=hdrs, timeout=timeout_s)
        except httpx.TimeoutException:
            cause = f"timed out after {timeout_s:g} s"
        except httpx.TransportError as err:
            cause = f"{type(err).__name__}: {_first_line(str(err))}"
        else:
            latency = time.monotonic() - t0
            if r.status_code == 200:
                try:
                    answer = parse(r.json())
                except (ValueError, KeyError, IndexError, TypeError, AttributeError):
                    cause = f"HTTP 200 with a body that is not a {kind}"
                else:
                    answer.latency_s, answer.attempts = latency, attempt + 1
                    return answer
            elif r.status_code == 429 or r.status_code >= 500:
                cause = f"HTTP {r.status_code}"
                retry_after = r.headers.get("retry-after")
            else:
                raise JudgeFailure(f"HTTP {r.status_code}: {_first_line(r.text)}", attempt + 1, retryable=False)
        if attempt < retries:
            await asyncio.sleep(_backoff(attempt, retry_after))
    raise JudgeFailure(cause, retries + 1)
