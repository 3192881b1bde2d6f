"""What `grpo init` checks of a `judge` reward before it writes anything (pydantic has already
required base_url, model and rubric): the API key's variable is set, the rubric names only
columns the dataset has, and the server answers one cheap request (GET /models) and serves the
model (skipped with `grpo init --no-judge-check`, for a server that is not up yet).
"""

from __future__ import annotations

import os

from pipeline.errors import GRPOError
from pipeline.rewards.judge.client import endpoint, headers
from pipeline.rewards.judge.options import JudgeOptions

REACH_TIMEOUT_S = 10.0


def check_judge(o: JudgeOptions, label: str, columns: list[str], data: str, reach: bool = True) -> None:
    if o.api_key_env and not os.environ.get(o.api_key_env):
        raise GRPOError(f"{label}.kwargs.api_key_env: the environment variable {o.api_key_env} is not set (it holds the judge's API key)")
    for column in o.columns():
        if column not in columns:
            raise GRPOError(f"{label}.kwargs.rubric: names {{{column}}}, but data.train {data} has no column {column!r} "
                            f"(columns: {', '.join(columns)}; the rubric also knows {{prompt}} and {{completion}})")
    if reach:
        reachable(o, label)


def reachable(o: JudgeOptions, label: str) -> None:
    """One GET of base_url/models: the server answers, accepts the key, and lists the model."""
    import httpx

    url = endpoint(o, "models")
    skip = "; grpo init --no-judge-check skips this check"
    try:
        r = httpx.get(url, headers=headers(o), timeout=REACH_TIMEOUT_S)
    except httpx.HTTPError as err:
        raise GRPOError(f"{label}.kwargs.base_url: {url} cannot be reached ({type(err).__name__}){skip}") from None
    if r.status_code in (401, 403):
        raise GRPOError(f"{label}.kwargs.api_key_env: {url} refused the key (HTTP {r.status_code}){skip}")
    if r.status_code != 200:
        raise GRPOError(f"{label}.kwargs.base_url: {url} answered HTTP {r.status_code}, not an OpenAI-compatible model list{skip}")
    try:
        served = [m.get("id") for m in r.json().get("data", [])]
    except (ValueError, AttributeError, TypeError):
        raise GRPOError(f"{label}.kwargs.base_url: {url} answered something that is not a model list{skip}") from None
    if served and o.model not in served:
        shown = ", ".join(map(str, served[:5])) + (", ..." if len(served) > 5 else "")
        raise GRPOError(f"{label}.kwargs.model: {o.model!r} is not served at {o.base_url} (it serves {shown}){skip}")
