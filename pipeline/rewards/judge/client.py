"""One request to a served reward over HTTP (httpx): the chat-completions body, its hash, retries
with backoff, and what the server says it serves. `ask` reads any JSON answer through a `parse`
function: a chat completion's (here) for `judge`, a classification's (served_model.py) for a
served `reward_model`.

httpx rather than the `openai` client: the status code, the retry headers, each attempt and its
latency are ours to count and record, where the openai client retries by itself, out of sight
(and it would add nothing else: the request is one POST of a JSON body). Retries follow the
openai client's rules (openai-python 1.x `_base_client`: `_should_retry`, `_calculate_retry_timeout`),
so that a hosted API's rate limits are waited out as its own client waits them out; its limit on a
server's delay is the current client's (openai 3.x, the one installed beside this project: 120 s, and a
longer one is not retried), where 1.x waited up to 60 s and answered a longer one with its short backoff,
which spends every retry before the server's window ends.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only
    from pipeline.config.judge import JudgeOptions

BACKOFF_S = 0.5
"""The first retry waits about this long, each further one twice as long (at most MAX_BACKOFF_S), less up to 25 %
(openai-python 1.x's INITIAL_RETRY_DELAY, MAX_RETRY_DELAY and jitter)."""
MAX_BACKOFF_S = 8.0
MAX_RETRY_AFTER_S = 120.0
"""A server's `retry-after-ms` / `retry-after` (seconds or an HTTP date) is waited for when it asks 0 to this many
seconds; an unreadable one (or none, or 0) gives the exponential backoff; a longer one is not retried (openai 3.x's
MAX_RETRY_AFTER_DELAY, `_calculate_retry_timeout` and `_should_retry`)."""
RETRIED = frozenset({408, 409, 429})
"""Statuses retried, besides every 5xx (openai-python's `_should_retry`); `x-should-retry: true/false` overrides."""
REFUSED_ALL = frozenset({401, 403, 404})
"""Statuses that refuse every request alike (a wrong or expired key, no access, no such model or path): no
failure of one request, so they stop the stage whatever `on_failure` says (served_rewards)."""
RETRIED_FINISH = frozenset({"abort", "error"})
"""Finish reasons of an HTTP 200 retried like a 5xx: vLLM v1 answers `abort` for a request its engine dropped (a
pause for a weight update, a shutdown) and `error` for an internal error it calls retryable, each with the partial
text written so far, which is no verdict (verdict.UNFINISHED)."""


class JudgeFailure(Exception):
    """A request that got no answer after its retries (or one the server refused outright)."""

    def __init__(self, cause: str, attempts: int, retryable: bool = True, status: int | None = None):
        super().__init__(f"{cause} ({attempts} attempt{'s' if attempts != 1 else ''})")
        self.attempts = attempts
        self.retryable = retryable
        self.status = status


@dataclass
class Answer:
    text: str | None
    latency_s: float
    """Seconds of the answered attempt."""
    prompt_tokens: int | None
    completion_tokens: int | None
    server_model: str | None
    attempts: int
    finish_reason: str | None = None
    """Why the server stopped writing (a chat completion's `finish_reason`): `length` means cut off."""


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
    from pipeline.config.urls import remember

    out = {"Content-Type": "application/json"}
    if o.api_key_env:
        key = os.environ.get(o.api_key_env, "")
        remember(key)  # masked in any text from here on, as a URL's secret is
        out["Authorization"] = f"Bearer {key}"
    return out


def endpoint(o, path: str = "chat/completions") -> str:
    """base_url + `/path`, its query (`?key=${NAME}`, pipeline/config/urls.py) kept after the path."""
    return joined(o.base_url, path)


def joined(base_url: str, path: str, strip: str = "") -> str:
    """`base_url` with `/path` appended to its path (after removing the suffix `strip`), its query kept."""
    base, sep, query = base_url.partition("?")
    return f"{base.rstrip('/').removesuffix(strip).rstrip('/') if strip else base.rstrip('/')}/{path}{sep}{query}"


IDENTITY = ("id", "root", "parent", "owned_by", "max_model_len")
"""What a `/models` entry says of the model behind a name (vLLM: `root` is the weights it loaded); its
`created` (vLLM: the time of the request) and `permission` change with every request and are left out."""


def identity_of(model: str):
    """A `parse` for GET /models: the entry of `model` as canonical JSON (Answer.text; None when not listed)."""

    def parse(data: dict) -> Answer:
        entry = next((m for m in data["data"] if m.get("id") == model), None)
        text = None if entry is None else json.dumps({k: entry[k] for k in IDENTITY if k in entry}, sort_keys=True)
        return Answer(text=text, latency_s=0.0, prompt_tokens=None, completion_tokens=None, server_model=None, attempts=0)

    return parse


async def served_identity(client, o, hdrs: dict, timeout_s: float, retries: int) -> str | None:
    """What the server at `o.base_url` reports it serves under `o.model` (its /models entry), or None
    when it reports nothing (no such entry, or no model list: a 404): part of every verdict's cache key
    (record.Ledger.get). A model list that fails otherwise raises its JudgeFailure: read as "nothing",
    the verdicts would be recorded under no server, and a resumed scoring whose list answers would not
    reuse them (its parts would differ from an uninterrupted run's)."""
    try:
        return (await ask(client, endpoint(o, "models"), None, hdrs, timeout_s, retries, identity_of(o.model), "model list")).text
    except JudgeFailure as failure:
        if failure.status == 404:
            return None
        raise


def server_delay(headers, now: float | None = None) -> float | None:
    """Seconds the server asks to wait: `retry-after-ms`, else `retry-after` as seconds or as an HTTP date
    (`now`: the clock it is compared with); None when it asks nothing readable."""
    import email.utils

    for name, per_s in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        try:
            said = float(headers[name])
        except (KeyError, TypeError, ValueError):
            continue
        if said == math.inf and headers[name].strip().lower() not in ("inf", "+inf", "infinity", "+infinity"):
            return MAX_RETRY_AFTER_S + 1  # a number too large for a float ("1e999"): a delay too long, not no delay
        return said / per_s
    try:
        when = email.utils.parsedate_to_datetime(headers["retry-after"]).timestamp()
    except (KeyError, TypeError, ValueError, IndexError, OverflowError, OSError):
        return None
    return when - (time.time() if now is None else now)


def retry_delay(attempt: int, headers=None, now: float | None = None) -> float:
    """Seconds before retry number `attempt` + 1 (0-based): the server's delay when it asks 0 < d <= 120 s,
    else 0.5 s * 2**attempt, at most 8 s, less a random 0-25 %."""
    asked = server_delay(headers or {}, now)
    if asked is not None and math.isfinite(asked) and 0 < asked <= MAX_RETRY_AFTER_S:
        return asked
    return min(BACKOFF_S * 2**attempt, MAX_BACKOFF_S) * (1 - 0.25 * random.random())


def should_retry(status: int, headers, now: float | None = None) -> bool:
    """Whether an HTTP error is retried: never when the server asks to wait over MAX_RETRY_AFTER_S (a retry
    sooner is refused again), else as its `x-should-retry` says, else for 408, 409, 429 and 5xx."""
    asked = server_delay(headers, now)
    if asked is not None and math.isfinite(asked) and asked > MAX_RETRY_AFTER_S:
        return False
    said = headers.get("x-should-retry")
    if said in ("true", "false"):
        return said == "true"
    return status in RETRIED or status >= 500


def _first_line(text: str) -> str:
    line = (text.strip().splitlines() or [""])[0]
    return line if len(line) <= 120 else line[:117] + "..."


def _error_text(r) -> str:
    """An error answer's message (OpenAI's and vLLM's JSON errors: `message`, or `error.message`), else its text."""
    try:
        data = r.json()
        said = data.get("message") or (data.get("error") or {}).get("message")
    except (ValueError, AttributeError):
        said = None
    return said if isinstance(said, str) and said.strip() else r.text


def _redacted(text: str, hdrs: dict) -> str:
    """`text` with the API key sent in `hdrs` and every secret of a URL (pipeline/config/urls.py) masked: a
    server may quote the key it refused (a 401's message) or the URL it was sent."""
    from pipeline.config.urls import mask

    key = hdrs.get("Authorization", "").removeprefix("Bearer ").strip()
    return mask(text.replace(key, "***") if key else text)


def chat_answer(data: dict) -> Answer:
    """A chat completion's answer (attempts and latency filled in by `ask`); KeyError & co. when it is none."""
    text = data["choices"][0]["message"].get("content")
    usage = data.get("usage") or {}
    return Answer(text=text if isinstance(text, str) else None, latency_s=0.0, prompt_tokens=usage.get("prompt_tokens"),
                  completion_tokens=usage.get("completion_tokens"), server_model=data.get("model"), attempts=0,
                  finish_reason=data["choices"][0].get("finish_reason"))


async def ask(client, url: str, body: str | None, hdrs: dict, timeout_s: float, retries: int, parse=chat_answer,
              kind: str = "chat completion") -> Answer:
    """POST `body` (None: GET `url`) until it is answered, retrying as the `openai` client does:
    timeouts, lost connections, 408, 409, 429 and 5xx (or whatever `x-should-retry` says) are
    retried `retries` times after `retry_delay`; any other status fails at once, not retryable.
    An HTTP 200 whose JSON `parse` cannot read (it raises), or whose finish_reason says the server
    dropped it unfinished (RETRIED_FINISH), counts as a failed attempt ("not a
    <kind>"). `url` as the config has it: its `${NAME}` references are read from the environment here
    (pipeline/config/urls.py), a GRPOError when one is unset. Raises JudgeFailure."""
    import httpx

    from pipeline.config.urls import expand, mask, mask_json

    url = expand(url, f"the URL {url}")
    cause = "no attempt"
    for attempt in range(retries + 1):
        said = None
        t0 = time.monotonic()
        try:
            if body is None:
                r = await client.get(url, headers=hdrs, timeout=timeout_s)
            else:
                r = await client.post(url, content=body.encode(), headers=hdrs, timeout=timeout_s)
        except httpx.TimeoutException:
            cause = f"timed out after {timeout_s:g} s"
        except httpx.TransportError as err:
            cause = f"{type(err).__name__}: {_first_line(mask(str(err)))}"
        else:
            latency = time.monotonic() - t0
            if r.status_code == 200:
                try:
                    answer = parse(mask_json(r.json()))  # an answer echoing the key: masked before it is kept
                except (ValueError, KeyError, IndexError, TypeError, AttributeError):
                    cause = f"HTTP 200 with a body that is not a {kind}"
                else:
                    if answer.finish_reason not in RETRIED_FINISH:
                        answer.latency_s, answer.attempts = latency, attempt + 1
                        return answer
                    cause = f"HTTP 200 with finish_reason {answer.finish_reason}"
            elif should_retry(r.status_code, r.headers):
                cause, said = f"HTTP {r.status_code}", r.headers
            else:
                said_text = _first_line(_redacted(_error_text(r), hdrs))  # masked before it is cut
                raise JudgeFailure(f"HTTP {r.status_code}: {said_text}", attempt + 1, retryable=False, status=r.status_code)
        if attempt < retries:
            await asyncio.sleep(retry_delay(attempt, said))
    raise JudgeFailure(cause, retries + 1)
