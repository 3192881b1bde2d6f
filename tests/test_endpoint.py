"""Agents behind an endpoint (pipeline/agents/endpoint): an OpenAI-SDK program (examples/endpoint_agent.py)
talks to the endpoint grpo serves over its warm engine, here the HF engine on the session's tiny model.
The mask-1 tokens are what the engine samples again from the row's own prefix and the recorded seed; two
runs write the same bytes; streaming gives the same tokens; a rewritten history, a side call and an agent
that crashes, hangs, never calls or sends a malformed body each end (or not) as recorded."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import REPO, init_error_line, write_config, base_config

AGENT = str(REPO / "examples/endpoint_agent.py")

FAULTS = '''
import json, os, sys, time
import httpx
task = json.loads(os.environ["GRPO_TASK"])
mode = task["mode"]
if mode == "crash":
    sys.exit(3)
if mode == "hang":
    time.sleep(60)
if mode == "malformed":
    httpx.post(os.environ["OPENAI_BASE_URL"] + "/chat/completions", content=b"{not json",
               headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
# "none": exits without a call
'''


def rows(path: Path, modes: list[str] | None = None) -> str:
    out = []
    for i in range(4):
        a, b = 11 + 7 * i, 23 + 3 * i
        row = {"prompt": [{"role": "user", "content": f"What is {a} * {b}? Use the multiply tool."}], "answer": f"#### {a * b}"}
        if modes:
            row["mode"] = modes[i]
        out.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    return str(path)


def endpoint_run(make_run, tiny2k, tmp_path, name: str, command: list[str], data: str, **agent) -> str:
    ro = {"engine": "hf", "num_generations": 2, "prompts_per_iter": 2, "groups_per_part": 2, "max_new_tokens": 12,
          "max_episode_tokens": 120, "agent": {"command": command, **agent}}
    return make_run(name, model=tiny2k, data={"train": data, "eval": None, "system_prompt": None}, rollout=ro,
                    rewards=[{"fn": "correct"}])


def part_rows(run: str) -> list[dict]:
    return pq.read_table(Path(run) / "iter-0000/rollout/part-00000.parquet").to_pylist()


@pytest.fixture(scope="module")
def tiny2k(assets, tmp_path_factory) -> str:
    """The session's tiny model with a 2048-token context (the Hermes tool block is ~700 of its tokens)."""
    model = tmp_path_factory.mktemp("tiny2k") / "model"
    shutil.copytree(assets["model"], model)
    conf = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**conf, "max_position_embeddings": 2048}))
    return str(model)


def test_a_wrong_key_is_401_and_models_lists_the_policy():
    from openai import AuthenticationError, OpenAI

    from pipeline.agents.endpoint.server import Hub, Server

    hub = Hub("policy")
    server = Server(hub)
    try:
        key = hub.new_key()
        assert [m.id for m in OpenAI(base_url=server.base_url, api_key=key, max_retries=0).models.list()] == ["policy"]
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=server.base_url, api_key="grpo-" + "0" * 32, max_retries=0).models.list()
    finally:
        server.close()


@pytest.mark.parametrize("agent, message", [
    ({"command": ["no-such-program-xyz"]}, "rollout.agent.command: 'no-such-program-xyz' is not a program on PATH"),
    ({"command": ["python", "missing_agent.py"]}, "rollout.agent.command: 'missing_agent.py': no such file"),
])
def test_bad_agent_commands_fail_at_init(assets, tmp_path, capsys, agent, message):
    cfg = base_config(assets, data={"train": assets["train"], "eval": None}, rollout={"agent": agent})
    line = init_error_line(capsys, tmp_path / "run", "--config", write_config(tmp_path / "cfg.yaml", cfg))
    assert line.startswith(message), line


def test_agent_beside_tools_is_refused(assets, tmp_path, capsys):
    cfg = base_config(assets, data={"train": assets["train"], "eval": None},
                      rollout={"agent": {"command": ["python", AGENT]}, "tools": ["examples/calc_tools.py:multiply"]})
    line = init_error_line(capsys, tmp_path / "run", "--config", write_config(tmp_path / "cfg.yaml", cfg))
    assert "rollout.agent" in line and "cannot be combined with rollout.tools" in line, line


@pytest.mark.slow
def test_openai_sdk_agent_token_exact_and_rerun_identical(make_run, tiny2k, tmp_path, monkeypatch):
    from pipeline.rollout import policy_engine, run_rollout
    from pipeline.run.run import Run

    data = rows(tmp_path / "calc.jsonl")
    monkeypatch.setenv("AGENT_SIDE", "1")  # a harness's side call (another model's name) before the first turn
    first = endpoint_run(make_run, tiny2k, tmp_path, "first", ["python", AGENT], data)
    engine = policy_engine(Run(first), 0)
    try:
        run_rollout(Run(first), 0, engine=engine)
        got = part_rows(first)
        assert len(got) == 4
        for row in got:
            rec = json.loads(row["episode"])
            ids, mask = row["completion_ids"], row["completion_mask"]
            turns = [q for q in rec["requests"] if q["kind"] == "turn"]
            assert rec["route"] == "endpoint" and rec["turns"] == len(turns) >= 1, rec
            assert [q["kind"] for q in rec["requests"]][0] == "side"
            side = rec["requests"][0]
            assert side["message"]["role"] == "assistant" and side["completion_ids"]
            # the row: turn 1 as sampled, then (glue mask 0, turn mask 1) per later turn; the side call in no token
            at, expect_mask = 0, []
            for t, q in enumerate(turns):
                delta = q.get("prompt_delta", [])
                assert ids[at:at + len(delta)] == delta
                at += len(delta)
                # the engine, given the row's own prefix and the recorded seed and cap, samples exactly the mask-1 span
                again = engine.generate([row["prompt_ids"] + ids[:at]], [q["seed"]], 1, max_tokens=[q["sampling"]["max_tokens"]])[0][0]
                assert again.token_ids == q["completion_ids"] == ids[at:at + len(q["completion_ids"])]
                assert q["logprobs"] == row["sampler_logprobs"][at:at + len(q["completion_ids"])]
                at += len(q["completion_ids"])
                expect_mask += [0] * len(delta) + [1] * len(q["completion_ids"])
            assert at == len(ids) and mask == expect_mask
            assert all(lp == 0.0 for lp, m in zip(row["sampler_logprobs"], mask) if m == 0)
            if len(turns) > 1:  # the agent's follow-up rendered by the template after the sampled turn, never re-tokenised
                assert "Please call the multiply tool." in row["completion"]
            assert rec["ending"] in ("finished", "length", "max_episode_tokens", "max_turns"), rec
            assert "grpo-" not in row["episode"]  # the episode's key is nowhere in the record
        assert any(json.loads(r["episode"])["turns"] > 1 for r in got)  # the multi-turn path ran
        # a second run of the same config: the same bytes
        second = endpoint_run(make_run, tiny2k, tmp_path, "second", ["python", AGENT], data)
        run_rollout(Run(second), 0, engine=engine)
        a, b = (Path(r) / "iter-0000/rollout/part-00000.parquet" for r in (first, second))
        assert a.read_bytes() == b.read_bytes()
        # streamed (stream_options.include_usage): the same tokens and messages; only what was asked differs
        streamed = endpoint_run(make_run, tiny2k, tmp_path, "streamed", ["python", AGENT, "--stream"], data)
        run_rollout(Run(streamed), 0, engine=engine)
        for x, y in zip(got, part_rows(streamed)):
            assert (x["completion_ids"], x["completion_mask"]) == (y["completion_ids"], y["completion_mask"])
            rx, ry = json.loads(x["episode"]), json.loads(y["episode"])
            assert [q.get("message") for q in rx["requests"]] == [q.get("message") for q in ry["requests"]]
            assert all(q["asked"].get("stream") for q in ry["requests"] if q["kind"] == "turn")
        # the agent edits grpo's answer before sending the history back: the episode ends there, trained up to it
        monkeypatch.setenv("AGENT_REWRITE", "1")
        monkeypatch.delenv("AGENT_SIDE")
        rewritten = endpoint_run(make_run, tiny2k, tmp_path, "rewritten", ["python", AGENT], data)
        run_rollout(Run(rewritten), 0, engine=engine)
        monkeypatch.delenv("AGENT_REWRITE")
        for x, y in zip(got, part_rows(rewritten)):
            ry = json.loads(y["episode"])
            first_turn = json.loads(x["episode"])["requests"][1]["completion_ids"]  # [0] was the side call
            assert y["completion_ids"] == first_turn and ry["turns"] == 1
            if ry["ending"] != "length":  # a cut first turn ends the episode before any history comes back
                assert ry["ending"] == "history_rewritten" and "not the assistant message grpo answered" in ry["detail"], ry
                assert ry["agent"]["exit_code"] != 0  # the SDK raised on the 400
        # faults: a crash, a hang past the timeout, a malformed body, no call at all: each recorded, the part written
        faults = tmp_path / "faults.py"
        faults.write_text(FAULTS)
        fdata = rows(tmp_path / "faults.jsonl", ["crash", "hang", "malformed", "none"])
        fault_run = make_run("faults", model=tiny2k, data={"train": fdata, "eval": None, "system_prompt": None},
                             rollout={"engine": "hf", "num_generations": 2, "prompts_per_iter": 4, "groups_per_part": 4,
                                      "max_new_tokens": 12, "max_episode_tokens": 120,
                                      "agent": {"command": [sys.executable, str(faults)], "timeout_s": 3}},
                             rewards=[{"fn": "correct"}])
        run_rollout(Run(fault_run), 0, engine=engine)
        endings = {r["mode"]: json.loads(r["episode"]) for r in part_rows(fault_run)}
        assert len(part_rows(fault_run)) == 8 and set(endings) == {"crash", "hang", "malformed", "none"}
        assert endings["crash"]["ending"] == "agent_crashed" and endings["crash"]["agent"]["exit_code"] == 3
        assert endings["hang"]["ending"] == "agent_timeout" and endings["hang"]["agent"]["killed"]
        assert endings["malformed"]["ending"] == "malformed_request" and "not JSON" in endings["malformed"]["detail"]
        assert endings["none"]["ending"] == "no_calls"
        assert all(r["completion_ids"] == [] for r in part_rows(fault_run))
    finally:
        engine.close()


def test_a_tool_call_answered_in_openai_shape_and_its_result_extend_the_record(make_run, tiny2k, tmp_path):
    """A turn that calls the tool (given, as tests/test_agents.py gives turns): OpenAI's tool_calls in the
    answer, streamed chunks the SDK reassembles to the same message; the SDK's echo of it (its null fields)
    and the tool result extend the record by the Hermes glue alone; a changed earlier message ends it."""
    import asyncio

    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    from pipeline.agents.endpoint.server import Request
    from pipeline.models.engines import Sample
    from pipeline.rollout import RolloutInputs
    from pipeline.run.run import Run

    sys.path.insert(0, str(REPO / "examples"))
    from endpoint_agent import TOOLS

    plan = RolloutInputs(Run(endpoint_run(make_run, tiny2k, tmp_path, "unit", ["python", AGENT], rows(tmp_path / "c.jsonl"))), 0)
    runner, tok, p = plan.episodes, plan.tokenizer, plan.prompts[0]
    e = runner.start(p, 0, 0, plan.group_seed(p.prompt_id), "test")
    loop = asyncio.new_event_loop()

    def ask(body):
        r = Request("k", body, None, loop, loop.create_future())
        return r, runner._request(e, r)

    def answer(r):
        loop.run_until_complete(asyncio.sleep(0))
        return r.future.result()

    body = {"model": "policy", "messages": [{"role": "user", "content": "What is 11 * 23?"}], "tools": TOOLS,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True, "temperature": 0.1}
    r1, job = ask(body)
    assert job.prompt == e.prompt_ids and '"name": "multiply"' in tok.decode(e.prompt_ids)  # the Hermes tool block
    assert job.entry["asked"]["temperature"] == 0.1 and job.entry["sampling"]["temperature"] == runner.cfg.temperature
    text = '<tool_call>\n{"name": "multiply", "arguments": {"a": 11, "b": 23}}\n</tool_call>'
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    runner._answer(job, Sample(text, ids, [-0.5] * len(ids), "stop"))
    status, payload, stream = answer(r1)
    message = ChatCompletion.model_validate(payload).choices[0].message
    assert status == 200 and payload["choices"][0]["finish_reason"] == "tool_calls" and payload["choices"][0]["token_ids"] == ids
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [("call_1_0", "multiply", {"a": 11, "b": 23})]
    chunks = [ChatCompletionChunk.model_validate(c) for c in stream]
    assert chunks[-1].usage.completion_tokens == len(ids) and not chunks[-1].choices
    assert [tc.function.arguments for c in chunks for ch in c.choices for tc in ch.delta.tool_calls or []] == [message.tool_calls[0].function.arguments]
    # the SDK's message sent back as it parsed it (refusal, audio, annotations: null), then the tool's result
    history = body["messages"] + [message.model_dump(), {"role": "tool", "tool_call_id": "call_1_0", "content": "253"}]
    r2, job2 = ask({**body, "messages": history})
    n = len(e.prompt_ids) + len(ids)
    assert job2.prompt[:n] == e.prompt_ids + ids  # the sampled tokens as sampled
    assert tok.decode(job2.prompt[n:]) == "\n<|im_start|>user\n<tool_response>\n253\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert e.mask == [1] * len(ids) + [0] * (len(job2.prompt) - n) and job2.seed != job.seed
    assert e.messages[1] == {"role": "tool", "name": "multiply", "content": "253", "error": None}
    assert job2.entry["prompt_delta"] == job2.prompt[n:]
    # an earlier message changed: the episode ends there, the agent is answered 400
    runner._answer(job2, Sample("253", [50, tok.eos_token_id], [-0.1, -0.2], "stop"))
    answer(r2)
    forged = [{"role": "user", "content": "What is 12 * 23?"}] + history[1:] + [{"role": "assistant", "content": "253"},
                                                                               {"role": "user", "content": "Thanks"}]
    r3, job3 = ask({**body, "messages": forged})
    assert job3 is None and e.ending == "history_rewritten" and e.detail.startswith("messages[0] (user) differs")
    assert answer(r3)[0] == 400 and e.requests[-1]["kind"] == "refused"
    loop.close()
