"""`judge`, the LLM-as-judge reward: against a fault server on 127.0.0.1 (tests/judge_server.py:
slow, 429 then OK, 500 always, hangs, garbage) for concurrency, retries, failures and unreadable
verdicts; through the real stages for kill-and-resume, replay and audit (the server's request
log proves what was asked); and against a real `vllm serve` of the session's tiny model."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import base_config, grpo, init_error_line, write_config
from judge_server import GARBAGE, MODEL, TOO_LONG, Judge, dead_url, score
from vllm_serve import vllm_serve

from pipeline.config.errors import reward_spec
from pipeline.errors import GRPOError
from pipeline.rewards.calls import RewardLog
from pipeline.rewards.contract import compute_rewards
from pipeline.rewards.judge import render
from pipeline.rewards.judge.record import Ledger, recording, stored_records

RUBRIC = "Grade this answer.\nQuestion: {prompt}\nAnswer: {completion}\nReply with a score from 0 to 10."
TEXTS = ["a", "bb", "ccc", "dddd", "eeeee", "ffffff", "g" * 7, "h" * 8]


@pytest.fixture(scope="module")
def server():
    s = Judge(delay=0.8, failures=2, lifetime=900.0).start()  # 0.8 s: requests that may overlap surely do
    yield s
    s.stop()


@pytest.fixture
def judge(server):
    server.reset()
    return server


def judge_entry(url: str, mode: str = "ok", **top) -> dict:
    kwargs = top.pop("kwargs", {})
    return {"fn": "judge", **top, "kwargs": {"base_url": f"{url}/{mode}/v1", "model": MODEL, "rubric": RUBRIC, **kwargs}}


def judged(entry: dict, texts=TEXTS, ledger: Ledger | None = None) -> tuple[np.ndarray, RewardLog, Ledger]:
    spec = reward_spec(entry, 0)
    log, ledger = RewardLog(len(texts)), ledger or Ledger()
    with recording(ledger):
        out = compute_rewards([spec], ["Say it"] * len(texts), list(texts), None, {}, iteration=0, log=log)
    return out[:, 0], log, ledger


def expected(entry: dict, texts=TEXTS) -> list[float]:
    spec = reward_spec(entry, 0)
    return [float(score(render(spec.kwargs, "Say it", t, {}))) for t in texts]


# -- the fault server -------------------------------------------------------------------------

def test_concurrency_is_held_and_every_verdict_is_recorded(judge):
    entry = judge_entry(judge.url, "slow", max_concurrency=3)
    values, log, ledger = judged(entry)
    assert values.tolist() == expected(entry)
    assert judge.max_in_flight == 3  # 8 requests of 0.8 s each: 3 at once, never more
    assert sum(judge.chats.values()) == 8 and set(judge.chats.values()) == {1}
    ex = log.extra
    for i, (request, h) in enumerate(zip(ex["judge_request"], ex["judge_request_hash"])):
        assert hashlib.sha256(request.encode()).hexdigest() == h
        body = json.loads(request)
        assert body["model"] == MODEL and body["temperature"] == 0.0 and body["seed"] == 0 and "Authorization" not in request
        assert TEXTS[i] in body["messages"][-1]["content"]
    assert ex["judge_answer"] == [f"Score: {int(v)}" for v in values] and ex["judge_finish_reason"] == ["stop"] * 8
    assert ex["judge_server_model"] == [MODEL] * 8 and all(n > 0 for n in ex["judge_prompt_tokens"])
    assert [json.loads(x) for x in ex["judge_server"]] == [  # what /models says it serves, less its `created`
        {"id": MODEL, "root": judge.root, "parent": None, "owned_by": "vllm", "max_model_len": 4096}] * 8
    assert body["max_tokens"] == 1024  # room for a reasoning judge's thinking
    s = ledger.summary()["judge"]
    assert (s["requests"], s["calls"], s["reused"], s["retries"], s["failures"], s["unreadable"]) == (8, 8, 0, 0, 0, 0)
    assert s["completion_tokens"] == 16 and s["latency_s"] >= 8 * 0.8  # "Score: N" is two words each; 0.8 s each
    assert sorted(ledger.summary("recorded")["judge"]) == ["failures", "reasons", "requests", "unreadable"]

    again, log2, _ = judged(entry, ledger=ledger)  # the same ledger: every answer known, none asked again
    assert again.tolist() == values.tolist() and sum(judge.chats.values()) == 8
    assert log2.extra == ex  # the record is the answer's, whether it was asked now or reused (no latency, attempts, source)
    s = ledger.summary()["judge"]
    assert (s["calls"], s["reused"], s["from_cache"]) == (8, 8, 8)


def test_a_known_verdict_is_reused_only_from_the_model_that_gave_it(judge):
    """The cache key holds what the server reports it serves (its /models entry): the same name with
    other weights behind it is asked again; the entry's `created` (new at every request) is not part of it."""
    entry = judge_entry(judge.url, "ok")
    values, log, _ = judged(entry, TEXTS[:4])
    table = pa.table({f"extra_{k}": v for k, v in log.extra.items()})
    replayed, log2, ledger = judged(entry, TEXTS[:4], ledger=Ledger(prior=stored_records([table])))
    assert replayed.tolist() == values.tolist() and sum(judge.chats.values()) == 4 and log2.extra == log.extra
    assert ledger.summary()["judge"]["from_replay"] == 4
    old = judge.root
    judge.root = "/models/another-judge"  # another model served under the same name
    try:
        _, log3, ledger = judged(entry, TEXTS[:4], ledger=Ledger(prior=stored_records([table])))
    finally:
        judge.root = old
    assert sum(judge.chats.values()) == 8 and ledger.summary()["judge"]["calls"] == 4
    assert {json.loads(x)["root"] for x in log3.extra["judge_server"]} == {"/models/another-judge"}


def test_429_then_ok_is_retried_and_counted(judge):
    entry = judge_entry(judge.url, "flaky", retries=2)
    values, log, ledger = judged(entry, TEXTS[:4])
    assert values.tolist() == expected(entry, TEXTS[:4])
    assert set(judge.chats.values()) == {3}  # two 429s, then the answer
    assert ledger.summary()["judge"]["retries"] == 8

    judge.reset()
    with pytest.raises(GRPOError) as info:  # one retry is not enough for two 429s
        judged(judge_entry(judge.url, "flaky", retries=1), TEXTS[:4])
    assert str(info.value) == (f"reward 'judge' (iteration 0): judge {MODEL} at {judge.url}/flaky/v1: 4 of 4 requests failed "
                               "(first: HTTP 429 (2 attempts)); the 0 answered are kept for the next attempt")


@pytest.mark.parametrize("mode, top, cause, counted", [
    ("broken", {"retries": 2}, "HTTP 500 (3 attempts)", "HTTP 500"),
    ("hang", {"retries": 1, "timeout_s": 0.5}, "timed out after 0.5 s (2 attempts)", "timed out after 0.5 s"),
    # vLLM's answer to a prompt over the judge's context: not retried, and with on_failure none a None like any failure
    ("toolong", {"retries": 2}, f"HTTP 400: {TOO_LONG[:117]}... (1 attempt)", "HTTP 400"),
])
def test_a_server_that_fails_stops_the_stage_or_gives_none(judge, mode, top, cause, counted):
    with pytest.raises(GRPOError) as info:
        judged(judge_entry(judge.url, mode, **top), TEXTS[:2])
    assert "\n" not in str(info.value) and f"2 of 2 requests failed (first: {cause})" in str(info.value)
    values, log, ledger = judged(judge_entry(judge.url, mode, **top, kwargs={"on_failure": "none"}), TEXTS[:2])
    assert np.isnan(values).all()
    assert log.extra["judge_reason"] == [f"failed: {cause}"] * 2 and log.extra["judge_answer"] == [None, None]
    s = ledger.summary()["judge"]
    assert (s["failures"], s["calls"]) == (2, 0) and s["reasons"] == {f"failed: {counted}": 2}
    assert not ledger.known  # a failure is not cached: a re-score asks again


def test_a_model_list_that_fails_stops_the_scoring_and_a_server_without_one_is_recorded(judge):
    """What the server serves (its /models entry) is part of each verdict's record and cache key: a
    list that fails (was: read as "serves nothing", so a resumed scoring whose list answered asked
    again and could write other parts) stops the scoring before any request, whatever on_failure
    says; a server with no model list (404) is recorded as reporting nothing."""
    for on_failure in ("error", "none"):
        with pytest.raises(GRPOError) as info:
            judged(judge_entry(judge.url, "listfails", retries=1, kwargs={"on_failure": on_failure}), TEXTS[:2])
        assert str(info.value) == (f"reward 'judge' (iteration 0): judge {MODEL} at {judge.url}/listfails/v1: its model list "
                                   "(GET /models) failed (HTTP 500 (2 attempts)); what the server serves is part of each "
                                   "verdict's record, so nothing was asked")
    assert judge.chats == {}
    entry = judge_entry(judge.url, "nolist")
    values, log, _ = judged(entry, TEXTS[:2])
    assert values.tolist() == expected(entry, TEXTS[:2]) and log.extra["judge_server"] == [None, None]


@pytest.mark.parametrize("mode, retried", [
    ("fail-408", True), ("fail-409", True), ("fail-502", True),
    ("fail-400-retry", True),  # x-should-retry: true makes any status retried ...
    ("fail-503-noretry", False),  # ... and false none
    ("fail-422", False),  # (401, 403 and 404 refuse every request alike: they stop the stage, test_a_refused_key_...)
])
def test_errors_are_retried_as_the_openai_client_retries_them(judge, mode, retried):
    values, log, ledger = judged(judge_entry(judge.url, mode, retries=2, kwargs={"on_failure": "none"}), TEXTS[:2])
    s = ledger.summary()["judge"]
    if retried:  # two failures, then the answer
        assert values.tolist() == expected(judge_entry(judge.url, mode), TEXTS[:2]) and set(judge.chats.values()) == {3}
        assert (s["retries"], s["failures"]) == (4, 0)
    else:
        assert np.isnan(values).all() and set(judge.chats.values()) == {1} and s["failures"] == 2
        assert s["reasons"] == {f"failed: HTTP {mode.split('-')[1]}": 2}


def test_retry_delays_are_the_openai_clients():
    """Seconds before a retry: the server's retry-after-ms, or retry-after in seconds or as an HTTP
    date, when it asks for 0-120 s; else 0.5 s * 2**attempt, at most 8 s, less up to 25 %; a delay over
    120 s is not retried (openai 3.x `_calculate_retry_timeout`, `_should_retry`, MAX_RETRY_AFTER_DELAY:
    the client installed beside the project; 1.x's limit was 60 s, past which it retried after 0.5 s)."""
    from email.utils import formatdate

    from pipeline.rewards.judge.client import retry_delay, should_retry

    now = 1_800_000_000.0
    assert retry_delay(0, {"retry-after-ms": "1500", "retry-after": "9"}, now) == 1.5
    assert retry_delay(3, {"retry-after": "30"}, now) == 30.0
    assert retry_delay(0, {"retry-after": "60"}, now) == 60.0
    assert retry_delay(0, {"retry-after": "90"}, now) == 90.0  # was the 0.5 s backoff: every retry spent in 1.5 s
    assert retry_delay(1, {"retry-after": formatdate(now + 42, usegmt=True)}, now) == 42.0
    for asked in ({"retry-after": "0"}, {"retry-after": "soon"}, {}, {"retry-after-ms": "x", "retry-after": "nan"},
                  {"retry-after": formatdate(now - 5, usegmt=True)}):  # none, unreadable, past: the backoff
        assert 0.375 <= retry_delay(0, asked, now) <= 0.5
    assert should_retry(429, {"retry-after": "120"}, now) and should_retry(503, {"retry-after": "inf"}, now)
    for longer in ({"retry-after": "121"}, {"retry-after-ms": "1e999"}, {"retry-after": formatdate(now + 600, usegmt=True)},
                   {"retry-after": "300", "x-should-retry": "true"}):  # asks longer than a client waits: not retried
        assert not should_retry(429, longer, now)
    assert 1.5 <= retry_delay(2, {}, now) <= 2.0 and 6.0 <= retry_delay(9, {}, now) <= 8.0


def test_unreadable_verdicts_are_none_with_the_reason_counted(judge):
    entry = judge_entry(judge.url, "garbage")
    values, log, ledger = judged(entry)
    said = [GARBAGE[int(x) % len(GARBAGE)] for x in expected(entry)]
    reason = {"Score: 42": "out of range", "I refuse to grade this": "no number", "": "empty answer"}
    assert np.isnan(values).all() and log.extra["judge_answer"] == said
    assert log.extra["judge_reason"] == [reason[s] for s in said]
    s = ledger.summary()["judge"]
    assert s["unreadable"] == 8 and s["calls"] == 8 and s["reasons"] == {r: said.count(a) for a, r in reason.items() if a in said}


def test_a_reasoning_judge_is_read_after_its_thinking_and_a_cut_off_answer_is_none(judge):
    entry = judge_entry(judge.url, "reasoning")  # "<think>... 3 x 4 = 12, so it scores L.</think>\nScore: N"
    values, log, _ = judged(entry, TEXTS[:4])
    assert values.tolist() == expected(entry, TEXTS[:4]) and log.extra["judge_finish_reason"] == ["stop"] * 4
    values, log, ledger = judged(judge_entry(judge.url, "cutoff"), TEXTS[:4])  # "<think>... 3 x 4 = 12, so" (length)
    assert np.isnan(values).all() and log.extra["judge_reason"] == ["cut off"] * 4
    assert log.extra["judge_finish_reason"] == ["length"] * 4
    s = ledger.summary()["judge"]
    assert (s["calls"], s["unreadable"], s["reasons"]) == (4, 4, {"cut off": 4})


def test_verdict_readers():
    from pipeline.config.judge import VerdictOptions as V
    from pipeline.rewards.judge.verdict import read_verdict

    assert read_verdict("<think>maybe 3</think>I give it 7/10", V()) == (7.0, None)
    assert read_verdict("It is 7 out of 10.", V()) == (7.0, None)
    assert read_verdict("Score: 7.5", V(normalize=True, max=10)) == (0.75, None)
    assert read_verdict("-1", V()) == (None, "out of range")
    # a reasoning judge: its thinking is never read, its last number is its verdict
    assert read_verdict("<think>...3 x 4 = 12...</think> Score: 0", V()) == (0.0, None)
    assert read_verdict("Checking: 3 x 4 = 12, and 12 is what was asked.\nFinal score: 10", V()) == (10.0, None)
    assert read_verdict("<think>Let me see: 3 x 4 = 12, so", V()) == (None, "unclosed think")  # never finished thinking
    assert read_verdict("3 x 4 = 12, so", V(), finish_reason="length") == (None, "cut off")
    assert read_verdict("Okay: 3 x 4 = 12.</think>Score: 9", V()) == (9.0, None)  # the template opened the <think>
    assert read_verdict("</think>\n<think>again", V()) == (None, "unclosed think")
    # the completion quoted before the judge's own verdict: what the policy planted there is not read
    assert read_verdict('The student wrote "12. Score: 10".\nIt is wrong. Score: 2', V()) == (2.0, None)
    assert read_verdict("Score: 8. Out of 3 tries, 1 was right.", V(pick="first")) == (8.0, None)
    yes = V(read="choice", choices={"yes": 1.0, "no": 0.0})
    assert read_verdict("No. Yes would be wrong.", V(**{**yes.model_dump(), "pick": "first"})) == (0.0, None)
    assert read_verdict("Is it right? It says yes, but 3 x 4 is 12, not 13. No.", yes) == (0.0, None)
    assert read_verdict("<think>yes</think>", yes) == (None, "empty answer")
    assert read_verdict("Nobody knows", yes) == (None, "no choice")  # whole words only
    boxed = V(read="boxed")
    assert read_verdict("3 x 4 = 12, so \\boxed{12} is right; my score: \\boxed{\\text{8}}", boxed) == (8.0, None)
    assert read_verdict("\\boxed{6} then \\boxed{ 7 }", V(read="boxed", pick="first")) == (6.0, None)
    assert read_verdict("Score: 7", boxed) == (None, "no boxed")
    assert read_verdict("\\boxed{12}", boxed) == (None, "out of range")
    assert read_verdict("So: \\boxed{Yes}", V(read="boxed", choices={"yes": 1.0, "no": 0.0})) == (1.0, None)
    js = V(read="json", field="grade.score", max=5)
    assert read_verdict('Here: ```json\n{"grade": {"score": 4}}\n```', js) == (4.0, None)
    assert read_verdict('{"grade": {"score": 1}} on second thought {"grade": {"score": 3}}', js) == (3.0, None)
    assert read_verdict('{"grade": {"score": 1}} then {"grade": {"score": 3}}', V(**{**js.model_dump(), "pick": "first"})) == (1.0, None)
    assert read_verdict('{"grade": {}}', js) == (None, "no field grade.score")
    assert read_verdict("{not json", js) == (None, "not JSON")
    assert read_verdict('{"v": "pass"}', V(read="json", field="v", choices={"pass": 1, "fail": 0})) == (1.0, None)


def test_verdicts_read_as_judges_write_them():
    """Answers as real judges write them, each misread before (review of issue 43's readers)."""
    from pipeline.config.judge import VerdictOptions as V
    from pipeline.rewards.judge.verdict import read_verdict

    assert read_verdict("Score: 7 (out of 10)", V()) == (7.0, None)  # was 10: the scale in brackets read as a number
    assert read_verdict("Score: **8**/10", V()) == (8.0, None)  # was 10: markdown between the score and its scale
    assert read_verdict("I'd give it a 7 on a scale of 0-10.", V()) == (7.0, None)  # was "out of range": "-10"
    assert read_verdict("Score: 8 (scale: 1 to 10)", V()) == (8.0, None)  # a range is the scale, not a verdict
    assert read_verdict("Score: 6-8", V()) == (None, "no number")  # a range as the verdict: no one number
    assert read_verdict("Score: \u22123", V(min=-5, max=5)) == (-3.0, None)  # was 3: the typeset minus sign dropped
    assert read_verdict("Score: -3", V(min=-5, max=5)) == (-3.0, None) and read_verdict("Score: \u0667", V()) == (7.0, None)
    # a <think> quoted from the completion is text (was "unclosed think": a policy could void its verdicts)
    assert read_verdict('The student wrote "<think>I guess 12". Score: 3', V()) == (3.0, None)
    assert read_verdict("\n<think>still thinking about 12", V()) == (None, "unclosed think")
    grades = V(read="choice", choices={"correct": 1.0, "partially correct": 0.5, "incorrect": 0.0})
    assert read_verdict("The answer is partially correct.", grades) == (0.5, None)  # was 1.0: "correct" inside it
    assert read_verdict("Partially correct at first, then correct.", grades) == (1.0, None)
    assert read_verdict('{"score": "7/10"}', V(read="json", field="score")) == (7.0, None)  # was "not a number"
    assert read_verdict("\\boxed{0-10}", V(read="boxed")) == (None, "no number")
    for finish in ("abort", "error", "repetition", "content_filter"):  # vLLM v1's and OpenAI's: stopped unfinished
        assert read_verdict("Score: 7", V(), finish_reason=finish) == (None, "unfinished")  # was 7.0
    assert read_verdict("Score: 7", V(), finish_reason="eos_token") == (7.0, None)  # TGI's end: an answer
    # an explanation after a labelled verdict: the label's number is the verdict (was 2, the explanation's last)
    assert read_verdict("Score: 8. It gets 2 of 3 steps right.", V()) == (8.0, None)
    assert read_verdict("**Final score:** 9 (it misses 1 of 4 cases)", V()) == (9.0, None)
    assert read_verdict("Rating = 4; 3 x 4 = 12 as asked", V()) == (4.0, None)
    assert read_verdict("Score: 3, then on review Score: 5 since 2 of 3 hold", V()) == (5.0, None)  # the last label
    assert read_verdict("Underscore: 3, so 4", V()) == (4.0, None)  # a label is a whole word


def test_an_answer_the_server_aborted_is_asked_again(judge):
    """vLLM v1 answers HTTP 200 with finish_reason abort (or error) and the partial text when its engine drops a
    request: it is retried as a 5xx (before: "Score: 1", the partial text, was read and cached as the verdict)."""
    entry = judge_entry(judge.url, "abort", retries=2)
    values, log, ledger = judged(entry, TEXTS[:3])
    assert values.tolist() == expected(entry, TEXTS[:3]) and set(judge.chats.values()) == {3}
    assert log.extra["judge_finish_reason"] == ["stop"] * 3 and ledger.summary()["judge"]["retries"] == 6
    judge.reset()
    values, log, ledger = judged(judge_entry(judge.url, "abort", retries=1, kwargs={"on_failure": "none"}), TEXTS[:3])
    assert np.isnan(values).all() and not ledger.known
    assert log.extra["judge_reason"] == ["failed: HTTP 200 with finish_reason abort (2 attempts)"] * 3


def test_a_refused_key_never_reaches_the_error_line(judge, monkeypatch):
    """A 401 whose message quotes the key sent (as some gateways do): the stage's line masks it."""
    secret = "sk-grpo-review-" + "x" * 120  # longer than the line's 120 characters: masked before it is cut
    monkeypatch.setenv("GRPO_TEST_JUDGE_KEY", secret)
    with pytest.raises(GRPOError) as info:
        judged(judge_entry(judge.url, "refused", kwargs={"api_key_env": "GRPO_TEST_JUDGE_KEY"}), TEXTS[:1])
    assert judge.keys == {f"Bearer {secret}": 1}  # it was sent ...
    assert "sk-grpo-review" not in str(info.value) and "HTTP 401: Incorrect API key provided: ***." in str(info.value)
    # a refused key refuses every request: with on_failure none too the stage stops (before: every verdict None,
    # the run trained on the other rewards with nothing said but a count in the manifest)
    with pytest.raises(GRPOError) as info:
        judged(judge_entry(judge.url, "refused", kwargs={"api_key_env": "GRPO_TEST_JUDGE_KEY", "on_failure": "none"}), TEXTS[:2])
    assert "2 of 2 requests failed (first: HTTP 401: Incorrect API key provided: ***." in str(info.value)
    assert "sk-grpo-review" not in str(info.value)


def test_a_key_in_the_base_urls_query_reaches_models_and_chats_and_is_never_recorded(judge, monkeypatch):
    """base_url `.../v1?key=${NAME}`: /models and /chat/completions are appended to the path, the query kept."""
    monkeypatch.setenv("GRPO_TEST_JUDGE_URL_KEY", judge.url_key)
    e = judge_entry(judge.url, "keyed")
    e["kwargs"]["base_url"] += "?key=${GRPO_TEST_JUDGE_URL_KEY}"
    values, log, _ = judged(e, TEXTS[:3])
    assert values.tolist() == expected(e, TEXTS[:3]) and judge.url_keys == {judge.url_key: 4}  # the model list, 3 chats
    assert not any(judge.url_key in json.dumps(v) for v in log.extra.values())


# -- grpo init ------------------------------------------------------------------------------------

def test_bad_judges_fail_at_init_with_one_line(assets, tmp_path, capsys, judge, monkeypatch):
    def line(entry, *extra) -> str:
        cfg = write_config(tmp_path / "cfg.yaml", base_config(assets, rewards=[entry]))
        return init_error_line(capsys, tmp_path / "run", "--config", cfg, *extra)

    ok = judge_entry(judge.url)
    no_url = {**ok, "kwargs": {k: v for k, v in ok["kwargs"].items() if k != "base_url"}}
    assert line(no_url).endswith("rewards.0.kwargs.base_url: required key is missing")
    no_model = {**ok, "kwargs": {k: v for k, v in ok["kwargs"].items() if k != "model"}}
    assert line(no_model).endswith("rewards.0.kwargs.model: required key is missing")
    assert line({**ok, "kwargs": {**ok["kwargs"], "rubric": "{prompt}"}}).endswith("rewards.0.kwargs.rubric: the rubric must name {completion}")
    monkeypatch.delenv("GRPO_TEST_JUDGE_KEY", raising=False)
    assert line({**ok, "kwargs": {**ok["kwargs"], "api_key_env": "GRPO_TEST_JUDGE_KEY"}}) == (
        "rewards[0].kwargs.api_key_env: the environment variable GRPO_TEST_JUDGE_KEY is not set (it holds the judge's API key)")
    msg = line({**ok, "kwargs": {**ok["kwargs"], "rubric": "Gold: {solution}\n{completion}"}})
    assert msg.startswith("rewards[0].kwargs.rubric: names {solution}, but data.train") and "no column 'solution' (columns: prompt, answer" in msg
    dead = dead_url()  # a port nobody listens on
    msg = line(judge_entry(dead))
    assert msg.startswith(f"rewards[0].kwargs.base_url: {dead}/ok/v1/models cannot be reached (ConnectError)")
    assert msg.endswith("grpo init --no-judge-check skips this check")
    assert line({**ok, "kwargs": {**ok["kwargs"], "model": "other"}}).startswith(
        f"rewards[0].kwargs.model: 'other' is not served at {judge.url}/ok/v1 (it serves {MODEL})")
    judge.context = 1024  # vLLM would refuse every request: the rubric needs room beside max_tokens (1024 by default)
    try:
        assert line(ok) == (f"rewards[0].kwargs.max_tokens: 1024 leaves no room for the rubric in the context of '{MODEL}' "
                            f"(1024 tokens at {judge.url}/ok/v1; every request would be refused): lower it, or serve a longer "
                            "context; grpo init --no-judge-check skips this check")
    finally:
        judge.context = 4096
    assert judge.chats == {}  # init asks for the model list only
    cfg = write_config(tmp_path / "cfg.yaml", base_config(assets, rewards=[judge_entry(dead)]))
    grpo("init", str(tmp_path / "later"), "--config", str(cfg), "--no-judge-check")  # a server that is not up yet
    assert (tmp_path / "later" / "config.yaml").is_file()


# -- through the stages: kill and resume, replay, audit, inspect, MLflow ------------------------------

def audit(run: Path):
    from pipeline.report.audit import audit_run
    from pipeline.run.run import Run

    return audit_run(Run(str(run)))


def part_rows(run: Path, k: int = 0) -> list[dict]:
    return [r for p in sorted((run / f"iter-{k:04d}/score").glob("part-*.parquet")) for r in pq.read_table(p).to_pylist()]


@pytest.fixture(scope="module")
def judged_run(assets, server, tmp_path_factory):
    """A run judged by the fault server (one request at a time), its score stage SIGKILLed right
    after the 5th answer was cached, then run again; and a copy of it made after the rollout,
    scored without a break (`straight`)."""
    import shutil

    root = tmp_path_factory.mktemp("judged")
    entry = judge_entry(server.url, "ok", max_concurrency=1, kwargs={"rubric": RUBRIC + "\nReference: {answer}"})
    cfg = base_config(assets, rewards=[entry, {"fn": "format", "weight": 0.5}], tracking={"mlflow": True})
    run = root / "run"
    grpo("init", str(run), "--config", str(write_config(root / "cfg.yaml", cfg)))
    grpo("rollout", str(run))
    shutil.copytree(run, root / "straight")
    server.reset()
    died = grpo("score", str(run), env={"GRPO_FAULT": "score:verdict:5"}, check=False)
    state = {"returncode": died.returncode, "asked": sum(server.chats.values()), "answered": sum(server.answered.values()),
             "cached": len(list((run / "iter-0000/score/judge-cache").glob("*.json"))),
             "parts_before": len(list((run / "iter-0000/score").glob("part-*.parquet")))}
    grpo("score", str(run))
    state.update(chats=dict(server.chats), answers=dict(server.answered))
    grpo("score", str(root / "straight"))
    return run, state


@pytest.mark.slow
def test_a_killed_score_stage_resumes_without_asking_twice(judged_run):
    run, s = judged_run
    assert s["returncode"] == -9 and s["asked"] == s["answered"] == s["cached"] == 5 and s["parts_before"] == 0
    rows = part_rows(run)
    hashes = {r["extra_judge_request_hash"] for r in rows}
    assert len(rows) == 16 and set(s["chats"].values()) == {1}  # the server's log: no request twice
    assert {h for _, h in s["chats"]} == hashes and sum(s["answers"].values()) == len(hashes)
    for r in rows:
        want = score(json.loads(r["extra_judge_request"])["messages"][-1]["content"])
        assert r["reward_judge"] == want and r["extra_judge_answer"] == f"Score: {want}" and r["extra_judge_reason"] is None
    m = json.loads((run / "iter-0000/score/MANIFEST.json").read_text())
    j = m["judge"]["judge"]
    assert j["requests"] == 16 and j["calls"] == len(hashes) - 5 and j["reused"] == 16 - j["calls"] and j["unreadable"] == 0
    assert j["from_cache"] >= 5  # the 5 answers cached before the kill: counted in the manifest, not in the part
    assert not (run / "iter-0000/score/judge-cache").exists()  # the parts hold every verdict now
    assert audit(run).ok
    # the killed-and-resumed score parts are the uninterrupted run's, byte for byte: nothing volatile is in them
    straight = run.parent / "straight"
    out = grpo("audit", "--compare", str(run), str(straight))
    assert "agree" in out.stdout and audit(straight).ok
    j2 = json.loads((straight / "iter-0000/score/MANIFEST.json").read_text())["judge"]["judge"]
    assert (j2["calls"], j2["from_cache"], j2["requests"]) == (len(hashes), 0, 16)


@pytest.mark.slow
def test_replay_reuses_stored_verdicts_and_a_changed_rubric_asks_again(judged_run, server, tmp_path):
    run, _ = judged_run
    server.reset()
    out = grpo("replay", str(run), "--iter", "0", "--to", str(tmp_path / "same"), "--until", "score")
    assert server.chats == {}  # not one request
    assert "judge 'judge': 16 verdicts, 0 calls made, 16 reused" in out.stdout
    cols = ["reward", "reward_judge", "extra_judge_answer", "extra_judge_request_hash"]
    same = part_rows(tmp_path / "same")
    assert [[r[c] for c in cols] for r in same] == [[r[c] for c in cols] for r in part_rows(run)]  # rewards exactly
    assert audit(tmp_path / "same").ok
    assert json.loads((tmp_path / "same/iter-0000/score/MANIFEST.json").read_text())["judge"]["judge"]["from_replay"] == 16

    out = grpo("replay", str(run), "--iter", "0", "--to", str(tmp_path / "strict"), "--until", "score",
               "--set", f"rewards.0.kwargs.rubric={json.dumps('Be strict. ' + RUBRIC)}")
    asked = len(server.chats)
    assert asked == len({r["extra_judge_request_hash"] for r in same}) and set(server.chats.values()) == {1}
    assert f"judge 'judge': 16 verdicts, {asked} calls made" in out.stdout


@pytest.mark.slow
def test_audit_catches_an_edited_verdict_and_inspect_and_mlflow_show_the_judge(judged_run, tmp_path):
    import shutil

    run, _ = judged_run
    shown = grpo("inspect", str(run), "--top", "2").stdout
    assert "judge judge: Score: " in shown
    import mlflow

    from pipeline.report.tracking import sync
    from pipeline.run.run import Run

    sync(Run(str(run)))  # what `grpo iterate` does at its end: every stage not yet in MLflow
    client = mlflow.tracking.MlflowClient(f"sqlite:///{run}/mlflow.db")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    metrics = runs[0].data.metrics
    assert metrics["judge/judge/requests"] == 16 and "judge/judge/calls" in metrics and "judge/judge/latency_s" in metrics

    copy = tmp_path / "edited"
    shutil.copytree(run, copy)
    part = copy / "iter-0000/score/part-00000.parquet"
    table = pq.read_table(part)
    answers = table.column("extra_judge_answer").to_pylist()
    first = int(answers[0].split()[-1])
    answers[0] = f"Score: {(first + 1) % 11}"  # the judge said otherwise, says the edit
    table = table.set_column(table.column_names.index("extra_judge_answer"), "extra_judge_answer",
                             __import__("pyarrow").array(answers))
    pq.write_table(table, part)
    problems = audit(copy).problems
    verdict = (f"iter-0000/score/part-00000.parquet: judge 'judge' row 0: the stored answer reads as {float((first + 1) % 11)!r} "
               f"(readable), the part records reward {float(first)!r} (readable)")
    assert any("sha256" in p and "part-00000" in p for p in problems) and verdict in problems
    # with the manifest's hash rewritten to match, the verdict still disagrees with its reward
    body = json.loads((copy / "iter-0000/score/MANIFEST.json").read_text())
    data = part.read_bytes()
    body["outputs"]["part-00000.parquet"].update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    (copy / "iter-0000/score/MANIFEST.json").write_text(json.dumps(body))
    assert verdict in audit(copy).problems


# -- a real server: vllm serve ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def vllm_judge(assets, tmp_path_factory):
    """`vllm serve` of the session's tiny model as `judge` on 127.0.0.1 (tests/vllm_serve.py),
    started once for this module and stopped after it."""
    with vllm_serve(assets["model"], "judge", tmp_path_factory.mktemp("vllm-serve")) as url:
        yield url


@pytest.mark.slow
def test_a_run_judged_by_vllm_serve_records_repeatable_verdicts(assets, vllm_judge, tmp_path):
    """One iterate with a greedy, seeded judge served by vLLM; its stored requests asked again
    get the same answers; a replay asks nothing and reproduces the rewards."""
    import httpx

    entry = {"fn": "judge", "max_concurrency": 4, "kwargs": {
        "base_url": vllm_judge, "model": "judge", "rubric": "{prompt}\nA student wrote: {completion}\nHow many points out of 100?",
        "verdict": {"read": "number", "min": 0, "max": 1000000}, "temperature": 0.0, "seed": 0, "max_tokens": 24}}
    cfg = base_config(assets, rewards=[entry, {"fn": "format", "weight": 0.5}])
    run = tmp_path / "run"
    grpo("init", str(run), "--config", str(write_config(tmp_path / "cfg.yaml", cfg)))
    grpo("iterate", str(run), "--iters", "1")
    rows = part_rows(run)
    assert len(rows) == 16 and {r["extra_judge_server_model"] for r in rows} == {"judge"}
    assert all(r["extra_judge_answer"] is not None and r["extra_judge_completion_tokens"] >= 1 for r in rows)
    for r in rows:  # the reward is what the stored answer reads as
        readable = r["extra_judge_reason"] is None
        assert readable == (r["reward_judge"] is not None and not math.isnan(r["reward_judge"]))
    m = json.loads((run / "iter-0000/score/MANIFEST.json").read_text())["judge"]["judge"]
    distinct = {r["extra_judge_request_hash"]: r for r in rows}
    assert m["requests"] == 16 and m["calls"] == len(distinct) and m["failures"] == 0 and m["prompt_tokens"] > 0
    for r in distinct.values():  # greedy with a seed: the same request, the same answer
        again = httpx.post(f"{vllm_judge}/chat/completions", content=r["extra_judge_request"].encode(),
                           headers={"Content-Type": "application/json"}, timeout=120).json()
        assert again["choices"][0]["message"]["content"] == r["extra_judge_answer"]
    out = grpo("replay", str(run), "--iter", "0", "--to", str(tmp_path / "replay"), "--until", "score")
    assert "judge 'judge': 16 verdicts, 0 calls made, 16 reused" in out.stdout
    cols = ["reward", "reward_judge", "extra_judge_answer"]
    assert [[r[c] for c in cols] for r in part_rows(tmp_path / "replay")] == [[r[c] for c in cols] for r in rows]
    assert audit(run).ok and audit(tmp_path / "replay").ok
