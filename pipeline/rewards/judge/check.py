"""What `grpo init` checks of a served reward before it writes anything (pydantic has already
required base_url, model and a judge's rubric): the API key's variable is set, a judge's rubric
names only columns the dataset has, and the server answers one cheap request (GET /models) and
serves the model; a served reward model is also sent one short text twice, which shows that the
server classifies, gives the `label` logit and obeys `use_activation: false` (both skipped with `grpo init --no-judge-check`, for a
server that is not up yet). An `openrlhf_server` has no model list and nothing to probe without
scoring: its `label_key` names a column, and its URL is answered at all (one GET, which OpenRLHF's
POST-only route answers 405; no answer, or a 404, is the wrong URL).
"""

from __future__ import annotations

import json
import os

from pipeline.config.urls import expand, mask
from pipeline.data import fields
from pipeline.errors import GRPOError
from pipeline.rewards.judge.client import endpoint, headers
from pipeline.rewards.openrlhf import check_label_key
from pipeline.config.judge import JudgeOptions
from pipeline.config.rewards import OpenRLHFServerOptions

REACH_TIMEOUT_S = 10.0
SKIP = "; grpo init --no-judge-check skips this check"


def check_served(o, label: str, sets: list[tuple[str, list[str], str]], reach: bool = True) -> None:
    """A `judge` (JudgeOptions) or a served `reward_model` (RewardModelOptions with base_url).
    `sets`: (path, columns, config key) of data.train and each eval set, where a rubric's columns must be."""
    if isinstance(o, JudgeOptions):
        return check_judge(o, label, sets, reach)
    if isinstance(o, OpenRLHFServerOptions):
        return check_openrlhf_server(o, label, sets, reach)
    key_is_set(o, label, "the reward model server's API key")
    if reach:
        reachable(o, label)
        classifies(o, label)


def key_is_set(o, label: str, whose: str) -> None:
    """The variable `api_key_env` names is set (when it names one), and every variable its URL references."""
    if o.api_key_env and not os.environ.get(o.api_key_env):
        raise GRPOError(f"{label}.kwargs.api_key_env: the environment variable {o.api_key_env} is not set (it holds {whose})")
    option = "url" if isinstance(o, OpenRLHFServerOptions) else "base_url"
    expand(getattr(o, option), f"{label}.kwargs.{option}")


def _send(url: str, o, label: str, option: str, **kw):
    """One request to `url` (the config's form: its ${NAME} read from the environment here)."""
    import httpx

    sent = expand(url, f"{label}.kwargs.{option}")
    return httpx.post(sent, headers=headers(o), **kw) if "content" in kw else httpx.get(sent, headers=headers(o), **kw)


def check_judge(o: JudgeOptions, label: str, sets: list[tuple[str, list[str], str]], reach: bool = True) -> None:
    key_is_set(o, label, "the judge's API key")
    for column in o.columns():  # a column, or a dotted path into one (pipeline.data.fields)
        for data, have, key in sets:
            try:
                fields.check(data, have, column, f"{label}.kwargs.rubric: names {{{column}}}, but {key}")
            except GRPOError as err:
                raise GRPOError(f"{err}; the rubric also knows {{prompt}} and {{completion}}") from None
    if reach:
        reachable(o, label)


def check_openrlhf_server(o, label: str, sets: list[tuple[str, list[str], str]], reach: bool = True) -> None:
    key_is_set(o, label, "the reward server's API key")
    for data, have, key in sets:  # data.train and every eval set: the eval scores with the same rewards
        check_label_key(o.label_key, label, have, data, key)
    if not reach:
        return
    import httpx

    try:
        r = _send(o.url, o, label, "url", timeout=REACH_TIMEOUT_S)
    except httpx.HTTPError as err:
        raise GRPOError(f"{label}.kwargs.url: {o.url} cannot be reached ({type(err).__name__}){SKIP}") from None
    if r.status_code in (401, 403):
        raise GRPOError(f"{label}.kwargs.{'api_key_env' if o.api_key_env else 'url'}: {o.url} refused the key "
                        f"(HTTP {r.status_code}){SKIP}")
    if r.status_code == 404:
        raise GRPOError(f"{label}.kwargs.url: {o.url} answered HTTP 404: no such route (OpenRLHF's serve_rm "
                        f"answers POST /get_reward){SKIP}")


def reachable(o, label: str) -> None:
    """One GET of base_url/models: the server answers, accepts the key, and lists the model."""
    import httpx

    url = endpoint(o, "models")
    try:
        r = _send(url, o, label, "base_url", timeout=REACH_TIMEOUT_S)
    except httpx.HTTPError as err:
        raise GRPOError(f"{label}.kwargs.base_url: {url} cannot be reached ({type(err).__name__}){SKIP}") from None
    if r.status_code in (401, 403):
        raise GRPOError(f"{label}.kwargs.{'api_key_env' if o.api_key_env else 'base_url'}: {url} refused the key "
                        f"(HTTP {r.status_code}){SKIP}")
    if r.status_code != 200:
        raise GRPOError(f"{label}.kwargs.base_url: {url} answered HTTP {r.status_code}, not an OpenAI-compatible model list{SKIP}")
    try:
        entries = [m for m in r.json().get("data", []) if isinstance(m, dict)]
        served = [m.get("id") for m in entries]
    except (ValueError, AttributeError, TypeError):
        raise GRPOError(f"{label}.kwargs.base_url: {url} answered something that is not a model list{SKIP}") from None
    if served and o.model not in served:
        shown = ", ".join(map(str, served[:5])) + (", ..." if len(served) > 5 else "")
        raise GRPOError(f"{label}.kwargs.model: {o.model!r} is not served at {o.base_url} (it serves {shown}){SKIP}")
    context = next((m.get("max_model_len") for m in entries if m.get("id") == o.model), None)  # vLLM reports it
    if isinstance(o, JudgeOptions) and isinstance(context, int) and o.max_tokens >= context:
        raise GRPOError(f"{label}.kwargs.max_tokens: {o.max_tokens} leaves no room for the rubric in the context of {o.model!r} "
                        f"({context} tokens at {o.base_url}; every request would be refused): lower it, or serve a longer "
                        f"context{SKIP}")


def classifies(o, label: str) -> None:
    """The probe text to a served reward model's /classify, with use_activation false and true
    (served_model.py): answers with logits, `label` among them, and the field obeyed."""
    import httpx

    from pipeline.rewards.judge.served_model import (
        check_obeyed,
        classification_answer,
        classify_url,
        probe_body,
    )

    url = classify_url(o.base_url)
    answers = []
    for flag in (False, True):
        try:
            r = _send(url, o, label, "base_url", content=probe_body(o, flag).encode(), timeout=REACH_TIMEOUT_S)
        except httpx.HTTPError as err:
            raise GRPOError(f"{label}.kwargs.base_url: {url} cannot be reached ({type(err).__name__}){SKIP}") from None
        if r.status_code != 200:
            said = (mask(r.text).strip().splitlines() or [""])[0][:160]
            raise GRPOError(f"{label}.kwargs.base_url: {url} answered HTTP {r.status_code} ({said}), not a classification: "
                            f"serve the model with `vllm serve MODEL --runner pooling`{SKIP}")
        try:
            answers.append(json.loads(classification_answer(r.json()).text))
            n = len(answers[0])
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            raise GRPOError(f"{label}.kwargs.base_url: {url} answered something that is not a classification{SKIP}") from None
    if o.label >= n:
        raise GRPOError(f"{label}.kwargs.label: {o.label} is no logit of {o.model!r}, which gives {n} (0..{n - 1})")
    try:
        check_obeyed(f"{label}.kwargs.base_url: {url}", *answers)
    except GRPOError as err:
        raise GRPOError(f"{err}{SKIP}") from None
