"""`openrlhf_server`: a reward server speaking OpenRLHF's protocol (POST {query, prompts, labels} ->
{rewards, scores, extra_logs}), asked with the judge's machinery. Against the fault server's
/<mode>/get_reward (tests/judge_server.py, a real HTTP server counting every request): the rewards are
the server's answers for the queries the file contract builds, concurrency and retries hold, every
request and answer is recorded and reused, `grpo init` refuses a bad config with one line; through the
real stages (slow): a killed score stage resumes without asking twice, replay asks nothing, audit
catches an edited answer.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import base_config, grpo, init_error_line, write_config
from judge_server import GARBAGE_REWARDS, Judge, dead_url, rm_reward, score

from pipeline.config.errors import reward_spec
from pipeline.errors import GRPOError
from pipeline.rewards.calls import RewardLog
from pipeline.rewards.contract import compute_rewards
from pipeline.rewards.judge.record import Ledger, recording, stored_records

RENDERED = ["<|user|>2+2?<|assistant|>", "<|user|>3+3?<|assistant|>", "<|user|>Say hi<|assistant|>"] * 2
PROMPTS = ["2+2?", "3+3?", [{"role": "user", "content": "Say hi"}]] * 2
TEXTS = ["<answer>4</answer>", "<answer>5</answer>", "hello", "four", "six", "hi there"]
COLUMNS = {"answer": ["4", "6", None, "4", "6", None]}
KEY = "GRPO_TEST_ORM_KEY"
URL_KEY = "GRPO_TEST_ORM_URL_SECRET"
"""The variable a keyed URL references, `?key=${GRPO_TEST_ORM_URL_SECRET}` (pipeline/config/urls.py)."""


def keyed(url: str, mode: str = "keyed", **top) -> dict:
    """An entry whose URL carries the fault server's ?key= as a reference to URL_KEY."""
    e = entry(url, mode, **top)
    e["kwargs"]["url"] += "?key=${" + URL_KEY + "}"
    return e


@pytest.fixture(scope="module")
def server():
    """The fault server, shared by the module; `rm` is it with its counters zeroed for one test."""
    s = Judge(delay=0.6, failures=2, lifetime=900.0).start()
    try:
        yield s
    finally:
        s.stop()


rm = pytest.fixture(lambda server: server.reset() or server, name="rm")


def entry(url: str, mode: str = "ok", **top) -> dict:
    kwargs = top.pop("kwargs", {})
    return {"fn": "openrlhf_server", "name": "orm", **top, "kwargs": {"url": f"{url}/{mode}/get_reward", "label_key": "answer", **kwargs}}


def served(e: dict, texts=TEXTS, ledger: Ledger | None = None, n: int | None = None):
    n = n or len(texts)
    spec = reward_spec(e, 0)
    log, ledger = RewardLog(n), ledger or Ledger()
    with recording(ledger):
        out = compute_rewards([spec], PROMPTS[:n], list(texts[:n]), None, {k: v[:n] for k, v in COLUMNS.items()},
                              iteration=0, log=log, rendered=RENDERED[:n])
    return out[:, 0], log, ledger


def sent(rm) -> int:
    return sum(rm.chats.values())


def test_the_reward_is_the_servers_answer_to_the_query_the_file_contract_builds(rm):
    from pipeline.rewards.openrlhf import inputs

    values, log, ledger = served(entry(rm.url))
    queries, prompts, labels = inputs(PROMPTS, RENDERED, TEXTS, COLUMNS, "answer", "here")
    assert queries == [p + t for p, t in zip(RENDERED, TEXTS)]  # the rendered prompt, then the completion
    want = [rm_reward(q, label) for q, label in zip(queries, labels)]
    assert len(set(want)) > 3  # the queries score differently: a mix-up would show
    assert values.tolist() == want
    ex = log.extra
    assert [json.loads(r) for r in ex["orm_request"]] == [{"query": [q], "prompts": [p], "labels": [label]}
                                                         for q, p, label in zip(queries, prompts, labels)]
    assert ex["dummy_scores"] == want and ex["query_chars"] == [len(q) for q in queries]  # extra_logs, one value each
    assert ex["orm_server"] == [f"{rm.url}/ok/get_reward"] * 6 and ex["orm_reason"] == [None] * 6
    for request, h, answer in zip(ex["orm_request"], ex["orm_request_hash"], ex["orm_answer"]):
        assert hashlib.sha256(request.encode()).hexdigest() == h and "scores" in json.loads(answer)
    assert sent(rm) == 6 and set(rm.chats.values()) == {1}  # one POST per completion, no /models asked
    s = ledger.summary()["orm"]
    assert (s["requests"], s["calls"], s["reused"], s["failures"], s["unreadable"]) == (6, 6, 0, 0, 0)


def test_no_label_key_sends_null_labels(rm):
    e = entry(rm.url)
    del e["kwargs"]["label_key"]
    values, log, _ = served(e, n=2)
    assert [json.loads(r)["labels"] for r in log.extra["orm_request"]] == [[None], [None]]
    assert values.tolist() == [rm_reward(p + t, None) for p, t in zip(RENDERED[:2], TEXTS[:2])]


def test_concurrency_is_held_the_key_never_recorded_and_answers_reused_by_a_resume_and_a_replay(rm, monkeypatch):
    monkeypatch.setenv(KEY, "sk-secret")
    e = entry(rm.url, "slow", max_concurrency=2, kwargs={"api_key_env": KEY})
    values, log, ledger = served(e)
    assert rm.max_in_flight == 2 and sent(rm) == 6  # 6 requests of 0.6 s each: 2 at once, never more
    assert rm.keys == {"Bearer sk-secret": 6}  # the key is sent ...
    assert not any("sk-secret" in json.dumps(v) for v in log.extra.values())  # ... and never recorded
    again, log2, _ = served(e, ledger=ledger)  # a resumed stage: its cache
    table = pa.table({f"extra_{k}": v for k, v in log.extra.items()})
    replayed, log3, ledger3 = served(e, ledger=Ledger(prior=stored_records([table])))  # a replay: the stored parts
    assert again.tolist() == replayed.tolist() == values.tolist() and sent(rm) == 6
    assert log2.extra == log3.extra == log.extra
    assert ledger3.summary()["orm"]["from_replay"] == 6 and ledger3.summary()["orm"]["calls"] == 0
    other = entry(rm.url, "ok", kwargs={"api_key_env": KEY})  # another URL: another server, asked again
    served(other, ledger=Ledger(prior=stored_records([table])))
    assert sent(rm) == 12


def test_a_url_key_is_sent_never_recorded_and_masked_where_a_server_quotes_it(rm, monkeypatch):
    secret = rm.url_key
    monkeypatch.setenv(URL_KEY, secret)
    values, log, _ = served(keyed(rm.url))
    assert rm.url_keys == {secret: 6} and values.tolist() == [rm_reward(p + t, a) for p, t, a in
                                                            zip(RENDERED, TEXTS, COLUMNS["answer"])]
    assert log.extra["orm_server"] == [f"{rm.url}/keyed/get_reward?key=${{{URL_KEY}}}"] * 6  # the reference, not the key
    assert not any(secret in json.dumps(v) for v in log.extra.values())
    rm.reset()  # a server answering an error that quotes the URL it was sent, key and all: masked where it is kept ...
    values, log, _ = served(keyed(rm.url, "keyed-echo", retries=0, kwargs={"on_failure": "none"}), n=2)
    assert rm.url_keys == {secret: 2} and np.isnan(values).all()
    assert log.extra["orm_reason"] == [f"failed: HTTP 400: cannot score at /keyed-echo/get_reward?key=*** (1 attempt)"] * 2
    with pytest.raises(GRPOError) as info:  # ... and where it is said
        served(keyed(rm.url, "keyed-echo", retries=0), n=1)
    assert secret not in str(info.value) and "cannot score at /keyed-echo/get_reward?key=*** (1 attempt)" in str(info.value)
    monkeypatch.setenv(URL_KEY, "wrong-key")  # a wrong key: refused, the stage stops whatever on_failure says
    with pytest.raises(GRPOError) as info:
        served(keyed(rm.url, retries=0, kwargs={"on_failure": "none"}), n=1)
    assert 'HTTP 401: {"detail": "no access to /keyed/get_reward?key=***"} (1 attempt)' in str(info.value)
    assert "wrong-key" not in str(info.value)  # a value sent is masked, right or wrong
    monkeypatch.delenv(URL_KEY)  # a resumed stage without the variable: one line naming it
    with pytest.raises(GRPOError) as info:
        served(keyed(rm.url), n=1)
    assert str(info.value).endswith(f"the URL {rm.url}/keyed/get_reward?key=${{{URL_KEY}}}: the environment variable "
                                    f"{URL_KEY} is not set (the URL's ${{{URL_KEY}}}: its value is never stored, so every "
                                    "process that sends a request reads it)")


def test_an_answer_quoting_the_key_a_key_given_encoded_and_a_bearer_key_with_a_newline_are_masked(rm, monkeypatch):
    """A 200 answer echoing the URL and the key it was sent is stored whole: masked before it is kept (the
    reward read from it is the same); a value given already percent-encoded, echoed decoded by the server,
    and a Bearer key read with a trailing newline, which httpx refuses quoting it, are masked too."""
    from urllib.parse import quote

    monkeypatch.setattr(rm, "url_key", "urlkey+/=" + rm.url_key)  # a key that must be encoded in a URL
    monkeypatch.setenv(URL_KEY, quote(rm.url_key, safe=""))  # given encoded: sent as it is, the server decodes it
    values, log, _ = served(keyed(rm.url, "keyed-log"), n=2)
    assert rm.url_keys == {rm.url_key: 2}
    assert values.tolist() == [rm_reward(p + t, a) for p, t, a in zip(RENDERED[:2], TEXTS[:2], COLUMNS["answer"][:2])]
    answers = [json.loads(a) for a in log.extra["orm_answer"]]
    assert [a["extra_logs"]["sent"] for a in answers] == [["/keyed-log/get_reward?key=***"]] * 2
    assert [a["extra_logs"]["sent_key"] for a in answers] == [["***"]] * 2
    assert not any(rm.url_key.removeprefix("urlkey+/=") in json.dumps(v) for v in log.extra.values())
    monkeypatch.setenv(KEY, "sk-newline-marker\n")  # as a key read from a file often is
    values, log, _ = served(entry(rm.url, retries=0, kwargs={"api_key_env": KEY, "on_failure": "none"}), n=1)
    assert np.isnan(values).all() and log.extra["orm_reason"][0].startswith("failed: LocalProtocolError: Illegal header value")
    assert "newline-marker" not in json.dumps(log.extra), log.extra["orm_reason"]


def test_more_secret_names_and_a_semicolon_separated_key_are_refused():
    """Names a key goes by beyond key/token/sig (authorization, jwt, plurals), and a `;`-separated
    parameter, which some servers read as `&`: refused written literally, accepted as a reference."""
    import pydantic

    from pipeline.config.rewards import validate_reward

    for query, name in (("authorization=m4rker", "authorization"), ("a=1;key=m4rker", "key"), ("api_keys=m4rker", "api_keys"),
                        ("jwt=m4rker", "jwt"), ("bearer=m4rker", "bearer"), ("hmac=m4rker", "hmac"),
                        ("passphrase=m4rker", "passphrase")):
        with pytest.raises(pydantic.ValidationError, match=f"its query parameter '{name}' holds a secret"):
            validate_reward(entry("http://127.0.0.1:5000", kwargs={"url": f"http://127.0.0.1:5000/get_reward?{query}"}))
        ref = validate_reward(entry("http://127.0.0.1:5000", kwargs={"url": "http://h:1/get_reward?" + query.replace("m4rker", "${K}")}))
        assert ref.kwargs.url.endswith("${K}")
    assert validate_reward(entry("http://127.0.0.1:5000", kwargs={"url": "http://h:1/get_reward?keyboard=qwerty"})).served


def test_a_run_written_before_the_rule_with_a_literal_key_reads_as_it_was(assets):
    """config.yaml and a manifest's rewards of a run made before URL secrets were refused: read (and
    sent, and hashed) as written, where a user's config with the same URL is refused."""
    from pipeline import config as config_mod
    from pipeline.config.rewards import validate_reward

    old = entry("http://127.0.0.1:5000")
    old["kwargs"]["url"] += "?key=literal-marker"
    tree = base_config(assets, rewards=[old])
    with pytest.raises(GRPOError, match="its query parameter 'key' holds a secret"):
        config_mod.resolve(tree)
    cfg = config_mod.from_yaml_text(yaml.safe_dump(tree), "RUN/config.yaml")
    assert cfg.rewards[0].kwargs.url.endswith("?key=literal-marker")
    assert validate_reward(cfg.rewards[0].model_dump(mode="json"), stored=True).kwargs.url == cfg.rewards[0].kwargs.url


def test_429_is_retried_a_broken_server_stops_the_stage_garbage_is_unreadable_and_a_clashing_log_refused(rm):
    values, _, ledger = served(entry(rm.url, "flaky", retries=2), n=3)
    assert values.tolist() == [rm_reward(p + t, a) for p, t, a in zip(RENDERED, TEXTS, COLUMNS["answer"][:3])]
    assert set(rm.chats.values()) == {3} and ledger.summary()["orm"]["retries"] == 6
    with pytest.raises(GRPOError) as info:
        served(entry(rm.url, "broken", retries=1), n=2)
    assert str(info.value) == (f"reward 'orm' (iteration 0): reward server {rm.url}/broken/get_reward: 2 of 2 requests failed "
                               "(first: HTTP 500 (2 attempts)); the 0 answered are kept for the next attempt")
    values, log, _ = served(entry(rm.url, "hang", retries=0, timeout_s=0.5, kwargs={"on_failure": "none"}), n=2)
    assert np.isnan(values).all() and log.extra["orm_reason"] == ["failed: timed out after 0.5 s (1 attempt)"] * 2
    values, log, _ = served(entry(rm.url, "garbage"))
    said = [GARBAGE_REWARDS[score(p + t) % len(GARBAGE_REWARDS)] for p, t in zip(RENDERED, TEXTS)]
    why = {0: "not one reward (0)", 1: "not a number", 2: "not finite"}
    assert np.isnan(values).all() and log.extra["orm_reason"] == [why[GARBAGE_REWARDS.index(s)] for s in said]
    with pytest.raises(GRPOError) as info:  # a log would overwrite the reward's own record of its answers
        served(entry(rm.url, "clash"), n=1)
    assert str(info.value) == ("reward 'orm' (iteration 0): the server's extra_logs name 'orm_answer', which is this "
                               "reward's own record; rename the reward (`name:`)")


def test_bad_configs_fail_at_init_with_one_line(assets, tmp_path, capsys, rm, monkeypatch):
    def line(e) -> str:
        cfg = write_config(tmp_path / "cfg.yaml", base_config(assets, rewards=[e]))
        return init_error_line(capsys, tmp_path / "run", "--config", cfg)

    ok = entry(rm.url)
    assert line({**ok, "kwargs": {"label_key": "answer"}}).endswith("rewards.0.kwargs.url: required key is missing")
    assert line({**ok, "kwargs": {**ok["kwargs"], "url": "localhost:5000"}}).endswith(
        "rewards.0.kwargs.url: 'localhost:5000' is not an http(s) URL (e.g. http://127.0.0.1:5000/get_reward)")
    secret = rm.url_key  # a secret written into the URL is refused before anything is written or sent
    for url, why in ((f"{rm.url}/keyed/get_reward?key={secret}", "its query parameter 'key' holds a secret"),
                     (f"{rm.url}/keyed/get_reward?Access_Token={secret}", "its query parameter 'Access_Token' holds a secret"),
                     (f"http://me:{secret}@127.0.0.1:5000/get_reward", "holds a user (user:password@)"),
                     (f"http://${{U}}:{secret}@127.0.0.1:5000/get_reward", "holds a password (user:password@)"),
                     (f"{rm.url}/ok/get_reward#{secret}", "holds a fragment (#...), which is never sent to a server")):
        said = line({**ok, "kwargs": {**ok["kwargs"], "url": url}})
        assert "rewards.0.kwargs.url: " in said and why in said and secret not in said, said
    assert rm.url_keys == {}
    monkeypatch.delenv(URL_KEY, raising=False)
    assert line(keyed(rm.url)) == (f"rewards[0].kwargs.url: the environment variable {URL_KEY} is not set (the URL's "
                                   f"${{{URL_KEY}}}: its value is never stored, so every process that sends a request reads it)")
    monkeypatch.setenv(URL_KEY, "wrong-key")
    assert line(keyed(rm.url)) == (f"rewards[0].kwargs.url: {rm.url}/keyed/get_reward?key=${{{URL_KEY}}} refused the key "
                                   "(HTTP 401); grpo init --no-judge-check skips this check")
    monkeypatch.setenv(URL_KEY, secret)
    dead = dead_url()  # an error line that quotes the URL: its reference, never the key
    assert line(keyed(dead)) == (f"rewards[0].kwargs.url: {dead}/keyed/get_reward?key=${{{URL_KEY}}} cannot be reached "
                                 "(ConnectError); grpo init --no-judge-check skips this check")
    assert line({**ok, "kwargs": {**ok["kwargs"], "model": "rm"}}).endswith(
        "rewards.0.kwargs.model: openrlhf_server has no option 'model' (options: url, label_key, api_key_env, on_failure)")
    msg = line({**ok, "kwargs": {**ok["kwargs"], "label_key": "gold"}})
    assert msg.startswith("rewards[0].kwargs.label_key: data.train") and "has no column 'gold' (columns: prompt, answer" in msg
    monkeypatch.delenv(KEY, raising=False)
    assert line({**ok, "kwargs": {**ok["kwargs"], "api_key_env": KEY}}) == (
        f"rewards[0].kwargs.api_key_env: the environment variable {KEY} is not set (it holds the reward server's API key)")
    dead = dead_url()  # a port nobody listens on
    assert line(entry(dead)) == (f"rewards[0].kwargs.url: {dead}/ok/get_reward cannot be reached (ConnectError); "
                                 "grpo init --no-judge-check skips this check")
    assert line({**ok, "kwargs": {**ok["kwargs"], "url": f"{rm.url}/ok/reward"}}) == (
        f"rewards[0].kwargs.url: {rm.url}/ok/reward answered HTTP 404: no such route (OpenRLHF's serve_rm answers "
        "POST /get_reward); grpo init --no-judge-check skips this check")
    rm.reset()
    grpo("init", str(tmp_path / "good"), "--config", str(write_config(tmp_path / "cfg.yaml", base_config(assets, rewards=[ok]))))
    assert (tmp_path / "good" / "config.yaml").is_file() and rm.chats == {}  # init scores nothing
    cfg = write_config(tmp_path / "cfg.yaml", base_config(assets, rewards=[entry(dead)]))
    grpo("init", str(tmp_path / "later"), "--config", str(cfg), "--no-judge-check")  # a server that is not up yet
    assert (tmp_path / "later" / "config.yaml").is_file()


def test_the_example_config_loads_and_passes_init_without_its_server(assets, monkeypatch):
    import yaml

    from conftest import REPO
    from pipeline import config as config_mod
    from pipeline import preflight

    monkeypatch.chdir(REPO)
    example = yaml.safe_load((REPO / "examples" / "openrlhf_server.yaml").read_text())
    cfg = config_mod.resolve(base_config(assets, rewards=example["rewards"]))
    assert [r.fn for r in cfg.rewards] == ["openrlhf_server"] and cfg.rewards[0].kwargs.label_key == "answer"
    preflight.check(cfg, judges_reachable=False)


# -- through the stages: kill and resume, replay, audit --------------------------------------------

def part_rows(run: Path, k: int = 0) -> list[dict]:
    return [r for p in sorted((run / f"iter-{k:04d}/score").glob("part-*.parquet")) for r in pq.read_table(p).to_pylist()]


def audit(run: Path):
    from pipeline.report.audit import audit_run
    from pipeline.run.run import Run

    return audit_run(Run(str(run)))


@pytest.fixture(scope="module")
def served_run(assets, server, tmp_path_factory):
    """A run scored by the fault OpenRLHF server (one request at a time) in its keyed mode, the key in
    the URL's query as `?key=${URL_KEY}` and MLflow on, its score stage SIGKILLed right after the 5th
    answer was cached, then run again (each stage reading the key from its own environment)."""
    root = tmp_path_factory.mktemp("openrlhf_served")
    cfg = base_config(assets, rewards=[keyed(server.url, max_concurrency=1), {"fn": "format", "weight": 0.5}],
                      tracking={"mlflow": True})
    run, env, said = root / "run", {URL_KEY: server.url_key}, []
    keep = lambda proc: said.append(proc.stdout + proc.stderr) or proc
    keep(grpo("init", str(run), "--config", str(write_config(root / "cfg.yaml", cfg)), env=env))
    keep(grpo("rollout", str(run), env=env))
    server.reset()
    died = keep(grpo("score", str(run), env={**env, "GRPO_FAULT": "score:verdict:5"}, check=False))
    state = {"returncode": died.returncode, "answered": sum(server.answered.values()),
             "cached": len(list((run / "iter-0000/score/judge-cache").glob("*.json")))}
    keep(grpo("score", str(run), env=env))
    state["chats"], state["url_keys"], state["said"] = dict(server.chats), dict(server.url_keys), said
    return run, state


@pytest.mark.slow
def test_a_served_run_scores_resumes_without_asking_twice_replays_asking_nothing_and_audit_catches_an_edit(
        served_run, server, tmp_path):
    import shutil

    run, s = served_run
    assert s["returncode"] == -9 and s["cached"] == 5
    rows = part_rows(run)
    assert len(rows) == 16 and set(s["chats"].values()) == {1}  # the server's log: no request twice
    assert s["url_keys"] == {server.url_key: len(s["chats"])}  # every request carried the key, the resumed stage's too
    assert {h for _, h in s["chats"]} == {r["extra_orm_request_hash"] for r in rows}
    assert {r["extra_orm_server"] for r in rows} == {f"{server.url}/keyed/get_reward?key=${{{URL_KEY}}}"}
    rollout = [r for p in sorted((run / "iter-0000/rollout").glob("part-*.parquet")) for r in pq.read_table(p).to_pylist()]
    by_key = {(r["prompt_id"], r["sample_idx"]): r for r in rollout}
    for r in rows:  # the reward is the server's answer to the rendered prompt + the completion, with its label
        got = by_key[(r["prompt_id"], r["sample_idx"])]
        query = got["prompt"] + got["completion"]
        assert json.loads(r["extra_orm_request"]) == {"query": [query], "prompts": [got["prompt"]], "labels": [got["answer"]]}
        assert r["reward_orm"] == rm_reward(query, got["answer"]) == r["extra_dummy_scores"]
    m = json.loads((run / "iter-0000/score/MANIFEST.json").read_text())
    assert m["judge"]["orm"]["requests"] == 16 and m["judge"]["orm"]["from_cache"] >= 5
    assert not (run / "iter-0000/score/judge-cache").exists() and audit(run).ok

    server.reset()  # a replay asks nothing, so it needs no key: URL_KEY is not in its environment
    out = grpo("replay", str(run), "--iter", "0", "--to", str(tmp_path / "same"), "--until", "score")
    assert server.chats == {} and server.url_keys == {}  # not one request
    assert (run / "mlflow.db").is_file() and "${" + URL_KEY + "}" in (run / "config.yaml").read_text()
    secret = server.url_key.encode()  # in no file of the run, its MLflow store and the replay's run, in no output
    kept = [p for d in (run.parent, tmp_path / "same") for p in d.rglob("*") if p.is_file() and secret in p.read_bytes()]
    assert kept == [] and not any(server.url_key in text for text in [*s["said"], out.stdout, out.stderr])
    assert "judge 'orm': 16 verdicts, 0 calls made, 16 reused" in out.stdout
    cols = ["reward", "reward_orm", "extra_orm_answer", "extra_dummy_scores"]
    assert [[r[c] for c in cols] for r in part_rows(tmp_path / "same")] == [[r[c] for c in cols] for r in rows]

    copy = tmp_path / "edited"
    shutil.copytree(run, copy)
    part = copy / "iter-0000/score/part-00000.parquet"
    table = pq.read_table(part)
    answers = table.column("extra_orm_answer").to_pylist()
    answers[0] = json.dumps({"rewards": [7.0]})  # the server said otherwise, says the edit
    pq.write_table(table.set_column(table.column_names.index("extra_orm_answer"), "extra_orm_answer", pa.array(answers)), part)
    reward = table.column("reward_orm").to_pylist()[0]
    assert (f"iter-0000/score/part-00000.parquet: judge 'orm' row 0: the stored answer reads as 7.0 (readable), "
            f"the part records reward {reward!r} (readable)") in audit(copy).problems

    logs = tmp_path / "edited_logs"  # an extra_logs column edited: audit reads it from the answers too
    shutil.copytree(run, logs)
    part = logs / "iter-0000/score/part-00000.parquet"
    table = pq.read_table(part)
    dummy = table.column("extra_dummy_scores").to_pylist()
    was, dummy[1] = dummy[1], 0.5 if dummy[1] != 0.5 else 0.25
    pq.write_table(table.set_column(table.column_names.index("extra_dummy_scores"), "extra_dummy_scores", pa.array(dummy)), part)
    assert (f"iter-0000/score/part-00000.parquet: judge 'orm' row 1: the stored answer's extra_logs give dummy_scores = "
            f"{was!r}, the part records extra_dummy_scores = {dummy[1]!r}") in audit(logs).problems


def test_a_dotted_label_key_sends_the_field_of_a_struct_column_at_init_and_when_scored(rm, assets, tmp_path):
    """verl-format data (reward_model.ground_truth), as issue 55 item 2 asks wherever a column is named:
    refused as 'no column' at init and in the stage before (r55s)."""
    from pipeline import config as config_mod
    from pipeline import preflight

    e = entry(rm.url, kwargs={"label_key": "reward_model.ground_truth"})
    truths = [{"ground_truth": "4", "style": "rule"}, None]  # a null struct: a null label, as a null column
    spec = reward_spec(e, 0)
    log = RewardLog(2)
    with recording(Ledger()):
        values = compute_rewards([spec], PROMPTS[:2], TEXTS[:2], None, {"reward_model": truths}, iteration=0, log=log,
                                 rendered=RENDERED[:2])[:, 0]
    assert [json.loads(r)["labels"] for r in log.extra["orm_request"]] == [["4"], [None]]
    assert values.tolist() == [rm_reward(RENDERED[0] + TEXTS[0], "4"), rm_reward(RENDERED[1] + TEXTS[1], None)]
    data = tmp_path / "verl.parquet"
    pq.write_table(pa.table({"prompt": ["2+2?"], "reward_model": [truths[0]]}), data)

    def checked(label_key: str, fn: str | None = None):
        e = entry(rm.url, kwargs={"label_key": label_key})
        if fn is not None:
            e = {"fn": fn, "contract": "openrlhf", "kwargs": {"label_key": label_key}}
        cfg = config_mod.resolve(base_config(assets, rewards=[e]))
        preflight.check(cfg.model_copy(update={"data": cfg.data.model_copy(update={"train": str(data), "eval": str(data)})}),
                        judges_reachable=False)  # the eval set is checked too: it scores with the same rewards

    checked("reward_model.ground_truth")
    with pytest.raises(GRPOError, match=r"rewards\[0\].kwargs.label_key: data.train .* has no column 'reward_model.gold': "
                                        r"'reward_model' has no field 'gold' \(fields: ground_truth, style\)"):
        checked("reward_model.gold")
    here = tmp_path / "rf.py"  # the file contract reads it the same way
    here.write_text("def reward_func(queries, prompts, labels):\n    return [float(labels[0] == '4')]\n")
    with pytest.raises(GRPOError, match=r"has no column 'reward_model.gold'"):
        checked("reward_model.gold", fn=f"{here}:reward_func")
    checked("reward_model.ground_truth", fn=f"{here}:reward_func")


def test_an_episodes_query_is_the_rollouts_recorded_text_with_the_template_between_its_turns(rm, tmp_path):
    """OpenRLHF decodes an episode's tokens, the template's glue and the tool results between the turns
    included; the query was the rendered prompt + the messages' contents fused with no separator (r55s)."""
    from pipeline.score import trl_inputs
    from schemas.artifacts import ROLLOUT

    prompt = "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    glue = "<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    recorded = call + glue + "It is 5."  # the rollout's `completion`: what the model and the template wrote, in order
    record = {"version": 1, "format": "hermes", "tools": ["add"], "observation": None, "turns": 2, "ending": "done",
              "model_tokens": 20, "context_tokens": 20, "messages": [
                  {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
                  {"role": "tool", "name": "add", "content": "5", "result": "5"},
                  {"role": "assistant", "content": "It is 5."}]}
    row = {"prompt_id": 0, "sample_idx": 0, "group_idx": 0, "prompt": prompt, "prompt_raw": json.dumps([{"role": "user", "content": "What is 2+3?"}]),
           "prompt_ids": [1], "completion": recorded, "completion_ids": [2] * 40, "sampler_logprobs": [0.0] * 40,
           "finish_reason": "stop", "truncated": False, "completion_length": 20, "policy_hash": "h",
           "completion_mask": [1] * 20 + [0] * 20, "episode": json.dumps(record), "answer": "5"}
    table = ROLLOUT.conform(pa.Table.from_pylist([row]))
    prompts, completions, ids, columns = trl_inputs(table, None)
    assert isinstance(completions[0], list)  # an episode: TRL's messages
    here = tmp_path / "rf.py"
    here.write_text("def reward_func(queries, prompts, labels):\n    return {'rewards': [0.0], 'extra_logs': {'q': [len(queries[0])]}}\n")
    specs = [reward_spec(entry(rm.url), 0), reward_spec({"fn": f"{here}:reward_func", "contract": "openrlhf", "name": "rf"}, 1)]
    log = RewardLog(1)
    with recording(Ledger()):
        out = compute_rewards(specs, prompts, completions, ids, columns, iteration=0, log=log,
                              rendered=table.column("prompt").to_pylist(), recorded=table.column("completion").to_pylist())
    assert json.loads(log.extra["orm_request"][0])["query"] == [prompt + recorded]
    assert out[0, 0] == rm_reward(prompt + recorded, "5") and log.extra["q"] == [len(prompt + recorded)]


def test_two_openrlhf_servers_logging_the_same_name_audit_clean_and_an_edit_of_the_second_is_caught(rm):
    """OpenRLHF's serve_rm always logs `dummy_scores`: two reward models served so (helpfulness, safety) log the
    same name; the second's lands in extra_<reward>_dummy_scores, where audit did not look: it compared the
    second server's answers with the first's column and reported an untouched run as edited (r55s)."""
    from types import SimpleNamespace

    from pipeline.report.audit_record import Audit
    from pipeline.report.audit_verdicts import _check_judge
    from pipeline.score import extra_column

    first, second = entry(rm.url), {**entry(rm.url), "name": "orm2"}
    del second["kwargs"]["label_key"]  # null labels: other rewards
    specs = [reward_spec(first, 0), reward_spec(second, 1)]
    log = RewardLog(3)
    with recording(Ledger()):
        out = compute_rewards(specs, PROMPTS[:3], TEXTS[:3], None, {k: v[:3] for k, v in COLUMNS.items()}, iteration=0,
                              log=log, rendered=RENDERED[:3])
    assert log.extra["dummy_scores"] == out[:, 0].tolist() != out[:, 1].tolist() == log.extra["orm2_dummy_scores"]
    cols = {f"reward_{s.column}": pa.array(out[:, j]) for j, s in enumerate(specs)}
    table = pa.table({**cols, **{f"extra_{k}": extra_column(v) for k, v in log.extra.items()}})

    def problems(t) -> list[str]:
        a = SimpleNamespace(audit=Audit("run"))
        for s in specs:
            _check_judge(a, "part", t, s)
        return a.audit.problems

    assert problems(table) == []
    edited = log.extra["orm2_dummy_scores"][:]
    edited[2] = 0.5 if edited[2] != 0.5 else 0.25
    i = table.column_names.index("extra_orm2_dummy_scores")
    assert problems(table.set_column(i, "extra_orm2_dummy_scores", pa.array(edited))) == [
        f"part: judge 'orm2' row 2: the stored answer's extra_logs give dummy_scores = {log.extra['orm2_dummy_scores'][2]!r}, "
        f"the part records extra_orm2_dummy_scores = {edited[2]!r}"]


def test_a_servers_log_that_another_reward_logged_first_never_overwrites_its_own_record(rm, tmp_path):
    """A name another reward logged first lands in <reward>_<name>: for a server logging `reason` that is its
    own record column extra_<reward>_reason, which it silently overwrote (r55s). Alone, it is logged as asked."""
    here = tmp_path / "rf.py"
    here.write_text("def reward_func(queries, prompts, labels):\n    return {'rewards': [1.0], 'extra_logs': {'reason': [2.0]}}\n")
    rf = reward_spec({"fn": f"{here}:reward_func", "contract": "openrlhf", "name": "rf"}, 0)
    values, log, _ = served(entry(rm.url, "reason"), n=2)  # alone: its `reason` column, its record untouched
    assert log.extra["reason"] == values.tolist() and log.extra["orm_reason"] == [None, None]
    with pytest.raises(GRPOError) as info, recording(Ledger()):
        compute_rewards([rf, reward_spec(entry(rm.url, "reason"), 1)], PROMPTS[:2], TEXTS[:2], None,
                        {k: v[:2] for k, v in COLUMNS.items()}, iteration=0, log=RewardLog(2), rendered=RENDERED[:2])
    assert str(info.value) == ("reward 'orm' (iteration 0): the server's extra_logs name 'reason' (as 'orm_reason': another "
                               "reward logged 'reason' first), which is this reward's own record; rename the reward (`name:`)")


def test_a_servers_error_quoting_another_secret_url_is_not_stored(monkeypatch):
    """Held: a reward server answering 500 whose body quotes a URL carrying the user's key and a credential it
    issued (`?sig=...`): neither is in what the score stage keeps."""
    import http.server
    import json
    import threading


    other = "presigned-SIG-7c1d9e"

    class H(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.dumps({"detail": f"moved: see http://127.0.0.1/blob?{self.path.split('?')[1]}&sig={other}"}).encode()
            self.send_response(500)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setenv(URL_KEY, "user-key-4b2a91")
    try:
        e = {"fn": "openrlhf_server", "name": "orm", "retries": 0,
             "kwargs": {"url": f"http://127.0.0.1:{srv.server_port}/get_reward?key=${{{URL_KEY}}}", "label_key": "answer",
                        "on_failure": "none"}}
        _, log, _ = served(e, n=1)
    finally:
        srv.shutdown()
    kept = json.dumps(log.extra)
    assert "user-key-4b2a91" not in kept, kept
    assert other not in kept, kept
