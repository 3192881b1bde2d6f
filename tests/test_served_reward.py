"""A served `reward_model`: a classifier behind vLLM's pooling server, asked over HTTP with the
judge's machinery. Against the fault server's /classify (tests/judge_server.py: slow, 429 then OK,
500 always, hangs, garbage) for the reward read as the in-process options say, concurrency,
retries, failures, unreadable answers, reuse and `grpo init`'s checks; against a real
`vllm serve --runner pooling` of a tiny classifier built here, whose served reward must equal
the in-process `reward_model` on the same weights; and, through `grpo eval`, the eval stage
recording a judge's and a served reward model's answers (kill and resume, audit, no second call).
"""

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
from judge_server import GARBAGE_LOGITS, MODEL, Judge, classified_text, dead_url, logits, score
from vllm_serve import vllm_serve

from pipeline.config.errors import reward_spec
from pipeline.errors import GRPOError
from pipeline.rewards.calls import RewardLog
from pipeline.rewards.contract import compute_rewards
from pipeline.rewards.judge.record import Ledger, recording, stored_records

PROMPTS = ["Rate this: "] * 4 + [[{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Say hi"}]] * 2
TEXTS = ["a", "bb", "ccc", "dddd", "hello there", "go away"]
KEY = "GRPO_TEST_RM_KEY"
PROBES = 2
"""Requests a scoring with something to ask (and `grpo init`) sends first: the probe text with use_activation false and true."""


@pytest.fixture(scope="module")
def server():
    s = Judge(delay=0.8, failures=2, lifetime=900.0).start()
    yield s
    s.stop()


@pytest.fixture
def rm(server):
    server.reset()
    return server


def rm_entry(url: str, mode: str = "ok", **top) -> dict:
    kwargs = top.pop("kwargs", {})
    return {"fn": "reward_model", "name": "rm", **top, "kwargs": {"model": MODEL, "base_url": f"{url}/{mode}/v1", **kwargs}}


def served(entry: dict, texts=TEXTS, prompts=PROMPTS, ledger: Ledger | None = None):
    spec = reward_spec(entry, 0)
    log, ledger = RewardLog(len(texts)), ledger or Ledger()
    with recording(ledger):
        out = compute_rewards([spec], list(prompts), list(texts), None, {}, iteration=0, log=log)
    return out[:, 0], log, ledger


def text_of(prompt, completion: str, use_prompt: bool = True) -> str:
    """What the fault classifier reads: prompt + completion, or the chat's contents and the completion."""
    if not use_prompt:
        return completion
    if isinstance(prompt, str):
        return prompt + completion
    return "\n".join([m["content"] for m in prompt] + [completion])


def by_hand(label=0, activation="none", sign=1, use_prompt=True, texts=TEXTS, prompts=PROMPTS) -> list[float]:
    """sign * activation(logits)[label], computed here with numpy from the server's own logits."""
    out = []
    for p, t in zip(prompts, texts):
        x = np.array(logits(text_of(p, t, use_prompt)))  # [2]
        if activation == "softmax":
            x = np.exp(x) / np.exp(x).sum()
        elif activation == "sigmoid":
            x = 1 / (1 + np.exp(-x))
        out.append(sign * x[label])
    return out


# -- the fault server -------------------------------------------------------------------------

def test_the_served_reward_is_read_as_the_in_process_options_say(rm):
    spread = by_hand()
    assert max(spread) - min(spread) > 0.5  # the texts score differently: a mix-up would show
    for options in ({}, {"label": 1}, {"label": 1, "activation": "softmax"}, {"activation": "sigmoid", "sign": -1},
                    {"use_prompt": False, "label": 1}):
        values, _, _ = served(rm_entry(rm.url, kwargs=options))
        np.testing.assert_allclose(values, by_hand(**options), rtol=0, atol=1e-12)
    # the texts the server was sent: plain prompts as `input`, chats as messages with the completion as the assistant's
    bodies = [json.loads(r) for r in served(rm_entry(rm.url))[1].extra["rm_request"]]
    assert bodies[0] == {"model": MODEL, "input": "Rate this: a", "use_activation": False, "truncate_prompt_tokens": 512}
    assert bodies[4]["messages"] == [*PROMPTS[4], {"role": "assistant", "content": "hello there"}] and "input" not in bodies[4]


def test_concurrency_is_held_and_every_answer_is_recorded(rm, monkeypatch):
    monkeypatch.setenv(KEY, "sk-secret")
    entry = rm_entry(rm.url, "slow", max_concurrency=2, kwargs={"label": 1, "max_length": 64, "api_key_env": KEY})
    values, log, ledger = served(entry)
    assert rm.max_in_flight == 2  # 6 requests of 0.8 s each: 2 at once, never more
    assert sum(rm.chats.values()) == 6 + PROBES and set(rm.chats.values()) == {1}
    assert rm.keys == {"Bearer sk-secret": 6 + PROBES}  # the key is sent ...
    ex = log.extra
    for i, (request, h) in enumerate(zip(ex["rm_request"], ex["rm_request_hash"])):
        assert hashlib.sha256(request.encode()).hexdigest() == h
        assert "sk-secret" not in request and json.loads(request)["truncate_prompt_tokens"] == 64  # ... and never recorded
        assert json.loads(ex["rm_answer"][i]) == logits(text_of(PROMPTS[i], TEXTS[i]))
    assert values.tolist() == [json.loads(a)[1] for a in ex["rm_answer"]]
    assert ex["rm_server_model"] == [MODEL] * 6 and ex["rm_reason"] == [None] * 6
    assert ex["rm_prompt_tokens"] == [len(text_of(p, t).split()) for p, t in zip(PROMPTS, TEXTS)]
    s = ledger.summary()["rm"]
    assert (s["requests"], s["calls"], s["reused"], s["retries"], s["failures"], s["unreadable"]) == (6, 6, 0, 0, 0, 0)
    assert s["latency_s"] >= 6 * 0.8

    # a re-score with this ledger (a resumed stage's cache), or with the answers stored in the part (a replay): no call
    again, log2, _ = served(entry, ledger=ledger)
    table = pa.table({f"extra_{k}": v for k, v in log.extra.items()})
    replayed, log3, ledger3 = served(entry, ledger=Ledger(prior=stored_records([table])))
    assert again.tolist() == replayed.tolist() == values.tolist() and sum(rm.chats.values()) == 6 + PROBES
    assert log2.extra == log3.extra == log.extra  # the part's record: the same whether asked, cached or replayed
    assert ledger.summary()["rm"]["from_cache"] == 6 and ledger3.summary()["rm"]["from_replay"] == 6
    assert ledger3.summary()["rm"]["calls"] == 0 and ledger3.summary()["rm"]["reused"] == 6
    served(rm_entry(rm.url, "slow", max_concurrency=2, kwargs={"label": 1, "max_length": 32, "api_key_env": KEY}),
           ledger=Ledger(prior=stored_records([table])))
    assert sum(rm.chats.values()) == 2 * (6 + PROBES)  # another truncation is another request: asked again


def test_a_key_in_the_base_urls_query_reaches_classify_and_is_never_recorded(rm, monkeypatch):
    monkeypatch.setenv("GRPO_TEST_RM_URL_KEY", rm.url_key)
    e = rm_entry(rm.url, "keyed", kwargs={"activation": "softmax", "label": 1})
    e["kwargs"]["base_url"] += "?key=${GRPO_TEST_RM_URL_KEY}"
    values, log, _ = served(e)
    assert values.tolist() == pytest.approx(by_hand(label=1, activation="softmax"))
    assert rm.url_keys == {rm.url_key: 1 + 2 + len(TEXTS)}  # the model list, the probe's two, one per completion
    assert not any(rm.url_key in json.dumps(v) for v in log.extra.values())


def test_429_then_ok_is_retried_and_a_failing_server_stops_the_stage_or_gives_none(rm):
    values, log, ledger = served(rm_entry(rm.url, "flaky", retries=2), TEXTS[:4], PROMPTS[:4])
    assert values.tolist() == by_hand(texts=TEXTS[:4], prompts=PROMPTS[:4])
    assert set(rm.chats.values()) == {3} and ledger.summary()["rm"]["retries"] == 8
    with pytest.raises(GRPOError) as info:
        served(rm_entry(rm.url, "broken", retries=1), TEXTS[:2], PROMPTS[:2])
    assert str(info.value) == (f"reward 'rm' (iteration 0): reward model {MODEL} at {rm.url}/broken/v1: 2 of 2 requests failed "
                               "(first: HTTP 500 (2 attempts)); the 0 answered are kept for the next attempt")
    values, log, ledger = served(rm_entry(rm.url, "hang", retries=0, timeout_s=0.5, kwargs={"on_failure": "none"}),
                                 TEXTS[:2], PROMPTS[:2])
    assert np.isnan(values).all() and log.extra["rm_reason"] == ["failed: timed out after 0.5 s (1 attempt)"] * 2
    assert ledger.summary()["rm"]["failures"] == 2 and not ledger.known  # a failure is not cached: asked again next time


def test_a_server_that_ignores_use_activation_is_caught_before_its_softmax_is_applied_twice(rm, assets, tmp_path, capsys):
    """An older vLLM (the field was `activation`) ignores use_activation: false and answers probabilities;
    read as logits they would be softmaxed again (rewards [0.31, 0.46, ...] for true [0.11, 0.41, ...])."""
    probs = by_hand(label=1, activation="softmax", texts=TEXTS[:2], prompts=PROMPTS[:2])  # what the server answers
    twice = [float(np.exp(p) / (np.exp(p) + np.exp(1 - p))) for p in probs]
    assert max(abs(a - b) for a, b in zip(probs, twice)) > 0.05  # the harm the check prevents would show
    for on_failure in ("error", "none"):  # not a failure of a request: the stage stops either way
        with pytest.raises(GRPOError) as info:
            served(rm_entry(rm.url, "ignores", kwargs={"label": 1, "activation": "softmax", "on_failure": on_failure}),
                   TEXTS[:2], PROMPTS[:2])
        msg = str(info.value)
        assert msg.startswith(f"reward 'rm' (iteration 0): reward model {MODEL} at {rm.url}/ignores/v1: the server ignores "
                              "use_activation: false (the same text gets [") and "\n" not in msg
        assert msg.endswith("probabilities, not logits), so the activation would be applied twice; serve the model with "
                            "a vLLM whose /classify knows use_activation, or score it in-process (no base_url)")
    assert sum(rm.chats.values()) == 2 * PROBES  # the completions were never sent
    cfg = write_config(tmp_path / "cfg.yaml", base_config(assets, rewards=[rm_entry(rm.url, "ignores", kwargs={"label": 1})]))
    line = init_error_line(capsys, tmp_path / "run", "--config", cfg)
    assert line.startswith(f"rewards[0].kwargs.base_url: {rm.url}/ignores/classify: the server ignores use_activation: false")
    assert line.endswith("; grpo init --no-judge-check skips this check")


def test_unreadable_logits_are_none_with_the_reason_counted(rm):
    values, log, ledger = served(rm_entry(rm.url, "garbage", kwargs={"label": 1}))
    said = [GARBAGE_LOGITS[score(text_of(p, t)) % len(GARBAGE_LOGITS)] for p, t in zip(PROMPTS, TEXTS)]
    reason = {0: "not logits", 1: "no label 1 (1 logits)", 2: "not finite"}
    want = [reason[GARBAGE_LOGITS.index(s)] for s in said]
    assert np.isnan(values).all() and log.extra["rm_reason"] == want
    s = ledger.summary()["rm"]
    assert s["unreadable"] == 6 and s["calls"] == 6 and sum(s["reasons"].values()) == 6
    assert s["reasons"].get("no label 1", 0) == want.count("no label 1 (1 logits)")


def test_bad_served_reward_models_fail_at_init_with_one_line(assets, tmp_path, capsys, rm, monkeypatch):
    def line(entry) -> str:
        cfg = write_config(tmp_path / "cfg.yaml", base_config(assets, rewards=[entry]))
        return init_error_line(capsys, tmp_path / "run", "--config", cfg)

    ok = rm_entry(rm.url)
    no_model = {**ok, "kwargs": {k: v for k, v in ok["kwargs"].items() if k != "model"}}
    assert line(no_model).endswith("rewards.0.kwargs.model: required key is missing")
    no_url = {**ok, "kwargs": {"model": MODEL, "api_key_env": KEY}}
    assert line(no_url).endswith("rewards.0.kwargs.api_key_env: names the key of a served model: set base_url too")
    assert line({**ok, "kwargs": {**ok["kwargs"], "label": "toxic"}}).endswith(
        "rewards.0.kwargs.label: 'toxic': a served model's label is a logit index (its server reports no label names)")
    monkeypatch.delenv(KEY, raising=False)
    assert line({**ok, "kwargs": {**ok["kwargs"], "api_key_env": KEY}}) == (
        f"rewards[0].kwargs.api_key_env: the environment variable {KEY} is not set (it holds the reward model server's API key)")
    dead = dead_url()  # a port nobody listens on
    assert line(rm_entry(dead)).startswith(f"rewards[0].kwargs.base_url: {dead}/ok/v1/models cannot be reached (ConnectError)")
    assert line({**ok, "kwargs": {**ok["kwargs"], "model": "other"}}).startswith(
        f"rewards[0].kwargs.model: 'other' is not served at {rm.url}/ok/v1 (it serves {MODEL})")
    assert line(rm_entry(rm.url, "broken")) == (
        f"rewards[0].kwargs.base_url: {rm.url}/broken/classify answered HTTP 500 (broken), not a classification: "
        "serve the model with `vllm serve MODEL --runner pooling`; grpo init --no-judge-check skips this check")
    assert line({**ok, "kwargs": {**ok["kwargs"], "label": 2}}) == (
        f"rewards[0].kwargs.label: 2 is no logit of '{MODEL}', which gives 2 (0..1)")
    rm.reset()
    cfg = write_config(tmp_path / "cfg.yaml", base_config(assets, rewards=[{**ok, "kwargs": {**ok["kwargs"], "label": 1}}]))
    grpo("init", str(tmp_path / "good"), "--config", str(cfg))
    assert (tmp_path / "good" / "config.yaml").is_file() and sum(rm.chats.values()) == PROBES  # one short text, twice


# -- eval: a judge's and a served reward model's answers recorded with the eval ----------------------

def eval_rows(run: Path, k: int = 0) -> list[dict]:
    return pq.read_table(run / f"iter-{k:04d}/eval/part-00000.parquet").to_pylist()


def audit(run: Path):
    from pipeline.report.audit import audit_run
    from pipeline.run.run import Run

    return audit_run(Run(str(run)))


@pytest.mark.slow
def test_eval_records_served_answers_resumes_without_asking_twice_and_audit_reads_them(assets, server, tmp_path):
    """`eval.reward` names a judge; a served reward model scores too. The eval is SIGKILLed after
    its 5th answer and run again: no request twice; the part holds every request and answer,
    audit re-reads them (and catches an edited one), and a second `grpo eval` asks nothing."""
    rubric = "Question: {prompt}\nAnswer: {completion}\nScore 0-10:"
    judge = {"fn": "judge", "max_concurrency": 1, "kwargs": {"base_url": f"{server.url}/ok/v1", "model": MODEL, "rubric": rubric}}
    rm = rm_entry(server.url, max_concurrency=1, kwargs={"label": 1, "activation": "sigmoid"})
    cfg = base_config(assets, rewards=[judge, rm, {"fn": "format", "weight": 0.5}], eval={"every": 0, "max_prompts": 6, "reward": "judge"})
    run = tmp_path / "run"
    grpo("init", str(run), "--config", str(write_config(tmp_path / "cfg.yaml", cfg)))
    server.reset()
    died = grpo("eval", str(run), "--iter", "0", env={"GRPO_FAULT": "eval:verdict:5"}, check=False)
    assert died.returncode == -9 and sum(server.answered.values()) == 5
    assert len(list((run / "iter-0000/eval/judge-cache").glob("*.json"))) == 5
    assert not (run / "iter-0000/eval/part-00000.parquet").exists()
    out = grpo("eval", str(run), "--iter", "0")
    assert set(server.chats.values()) == {1}  # the server's log: no request twice

    rows = eval_rows(run)
    assert len(rows) == 6 and not (run / "iter-0000/eval/judge-cache").exists()
    from pipeline.rewards.judge.served_model import probe_body

    probes = {hashlib.sha256(probe_body(reward_spec(rm, 1).kwargs, flag).encode()).hexdigest() for flag in (False, True)}
    assert {h for _, h in server.chats} == {r[f"extra_{c}_request_hash"] for r in rows for c in ("judge", "rm")} | probes
    for r in rows:
        user = json.loads(r["extra_judge_request"])["messages"][-1]["content"]
        assert r["reward_judge"] == score(user) and r["extra_judge_answer"] == f"Score: {score(user)}"
        assert r["correct"] == (score(user) > 0)  # eval.reward: the judge decides accuracy
        x = logits(classified_text(json.loads(r["extra_rm_request"])))[1]
        assert r["reward_rm"] == pytest.approx(1 / (1 + math.exp(-x)), abs=1e-12)
    m = json.loads((run / "iter-0000/eval/MANIFEST.json").read_text())
    assert m["judge"]["judge"]["from_cache"] + m["judge"]["rm"]["from_cache"] == 5
    assert m["judge"]["judge"]["requests"] == m["judge"]["rm"]["requests"] == 6
    assert m["judge"]["judge"]["calls"] + m["judge"]["rm"]["calls"] == 12 - 5
    assert [r["fn"] for r in m["rewards"]] == ["judge", "reward_model", "format"]
    assert "eval policy 0: accuracy" in out.stdout and audit(run).ok
    from pipeline.report.inspect import stage_metrics
    from pipeline.run.run import Run

    metrics = stage_metrics(Run(str(run)), 0, "eval")  # what MLflow gets for the eval
    assert metrics["eval/judge/judge/requests"] == metrics["eval/judge/rm/requests"] == 6
    assert metrics["eval/judge/judge/calls"] + metrics["eval/judge/rm/calls"] == 12 - 5

    server.reset()
    grpo("eval", str(run), "--iter", "0")  # done: the recorded eval stands, nothing is asked
    assert server.chats == {}

    part = run / "iter-0000/eval/part-00000.parquet"
    table = pq.read_table(part)
    answers = table.column("extra_rm_answer").to_pylist()
    answers[0] = json.dumps([0.0, 3.0])  # the model said otherwise, says the edit
    pq.write_table(table.set_column(table.column_names.index("extra_rm_answer"), "extra_rm_answer", pa.array(answers)), part)
    want = (f"iter-0000/eval/part-00000.parquet: judge 'rm' row 0: the stored answer reads as {1 / (1 + math.exp(-3.0))!r} "
            f"(readable), the part records reward {rows[0]['reward_rm']!r} (readable)")
    assert want in audit(run).problems


# -- a real server: vllm serve --runner pooling ----------------------------------------------------

@pytest.fixture(scope="module")
def tiny_classifier(assets, tmp_path_factory) -> str:
    """A seeded, randomly initialised 2-label Qwen2 sequence classifier shaped like the session's
    tiny model, saved with its tokenizer (byte-level BPE, ChatML template)."""
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )

    tok = AutoTokenizer.from_pretrained(assets["model"])
    config = AutoConfig.from_pretrained(assets["model"])
    config.update({"num_labels": 2, "id2label": {0: "calm", 1: "rude"}, "label2id": {"calm": 0, "rude": 1},
                   "pad_token_id": tok.pad_token_id, "architectures": ["Qwen2ForSequenceClassification"],
                   "initializer_range": 0.2, "torch_dtype": "float32"})
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    path = tmp_path_factory.mktemp("rm") / "classifier"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.mark.slow
def test_vllm_serve_gives_the_in_process_reward_and_every_request_is_recorded(tiny_classifier, tmp_path):
    """One `vllm serve --runner pooling` of the tiny classifier: the served reward equals the
    in-process `reward_model` on the same weights (plain and chat prompts, each activation), and
    each request and its logits are recorded and read back by themselves."""
    prompts = ["What is 2 + 3? ", "Name a colour: "] + [[{"role": "system", "content": "Answer briefly."},
                                                        {"role": "user", "content": "What is 4 * 5?"}]] * 2
    texts = [" 2 + 3 = 5. <answer>5</answer>", "blue, I think", "<answer>20</answer>", "I will not answer that"]
    with vllm_serve(tiny_classifier, "rm", tmp_path, "--runner", "pooling", "--dtype", "float32") as url:
        for options in ({"label": 1}, {"label": 0, "activation": "softmax", "sign": -1}, {"label": 1, "activation": "sigmoid"}):
            local = {"fn": "reward_model", "name": "rm", "kwargs": {"model": tiny_classifier, "device": "cpu", **options}}
            remote = {"fn": "reward_model", "name": "rm", "max_concurrency": 2, "kwargs": {"model": "rm", "base_url": url, **options}}
            want, _, _ = served(local, texts, prompts)
            got, log, ledger = served(remote, texts, prompts)
            assert np.ptp(want) > 1e-3  # the texts score differently, so a mix-up would show
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
            ex = log.extra
            assert ex["rm_server_model"] == ["rm"] * 4 and ex["rm_reason"] == [None] * 4
            assert {json.loads(x)["id"] for x in ex["rm_server"]} == {"rm"}
            assert all(n > 0 for n in ex["rm_prompt_tokens"]) and ledger.summary()["rm"]["calls"] == 4
            for request, h, answer in zip(ex["rm_request"], ex["rm_request_hash"], ex["rm_answer"]):
                assert hashlib.sha256(request.encode()).hexdigest() == h and len(json.loads(answer)) == 2
            assert "messages" in json.loads(ex["rm_request"][2]) and "input" in json.loads(ex["rm_request"][0])
            again, log2, _ = served(remote, texts, prompts, ledger=ledger)  # known answers: the same rewards, no call
            assert again.tolist() == got.tolist() and log2.extra == ex and ledger.summary()["rm"]["from_cache"] == 4
