"""verifiers (0.4, v1 API) environments through grpo's endpoint (`rollout.agent.verifiers`,
pipeline/agents/endpoint/vf_run.py and vf_episode.py): verifiers' documented Addition taskset
(tests/fixtures/verifiers/addition_v1, its code unchanged) played by verifiers' `null` harness in
the `subprocess` runtime, one `Env.run_episode` per episode against the endpoint.

The tests that run verifiers need an interpreter that has verifiers==0.4.0: grpo's own after
`pip install 'grpo[verifiers]'`, or any other named by GRPO_VERIFIERS_PYTHON (e.g. a venv made with
`python -m venv V && V/bin/pip install verifiers==0.4.0 uv`, kept apart from grpo's openai SDK).
Without one they are skipped, saying so; they never pass without running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, base_config, init_error_line, write_config

FIXTURE = str(REPO / "tests/fixtures/verifiers/addition_v1")
RUNTIME_FIXTURE = str(REPO / "tests/fixtures/verifiers/runtime_reward_v1")  # one trace-only reward, one that reads the runtime


def vf_python() -> str | None:
    """An interpreter that imports verifiers 0.4 (GRPO_VERIFIERS_PYTHON, else grpo's own), or None."""
    for py in (os.environ.get("GRPO_VERIFIERS_PYTHON"), sys.executable):
        if py and subprocess.run([py, "-c", "import verifiers.v1"], capture_output=True).returncode == 0:
            return py
    return None


VF = vf_python()
needs_vf = pytest.mark.skipif(VF is None, reason="verifiers is not installed: pip install 'grpo[verifiers]' "
                                                 "(or GRPO_VERIFIERS_PYTHON=an interpreter with verifiers==0.4.0 and uv)")


def vf_options(**over) -> dict:
    return {"taskset": "addition_v1", "taskset_args": {"num_tasks": 4}, "harness": "null", "runtime": "subprocess",
            "path": FIXTURE, "python": VF or "python", **over}


def vf_config(assets, data: str, model: str | None = None, **over) -> dict:
    return base_config(assets, **({"model": model} if model else {}), data={"train": data, "eval": None, "system_prompt": None},
                       rollout={"engine": "hf", "num_generations": 2, "prompts_per_iter": 2, "groups_per_part": 2,
                                "max_new_tokens": 12, "max_turns": 2, "max_episode_tokens": 48,
                                "agent": {"verifiers": vf_options(**over), "timeout_s": 240}},
                       rewards=[])


def addition_rows(path: Path, n: int = 2) -> str:
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?", "vf_task": i}) + "\n" for i in range(n)))
    return str(path)


@pytest.mark.parametrize("agent, message", [
    ({"command": ["python", "x.py"], "verifiers": {"taskset": "addition_v1"}}, "rollout.agent needs exactly one of `command`"),
    ({"verifiers": {"taskset": "addition_v1", "runtime": "prime"}}, "only the local `subprocess` runtime"),
])
def test_verifiers_options_refused_in_one_line(assets, tmp_path, capsys, agent, message):
    cfg = base_config(assets, data={"train": assets["train"], "eval": None}, rollout={"agent": agent}, rewards=[])
    line = init_error_line(capsys, tmp_path / "run", "--config", write_config(tmp_path / "cfg.yaml", cfg))
    assert message in line and "rollout.agent" in line, line


def test_an_endpoint_run_made_before_verifiers_keeps_its_config_hash():
    """rollout.agent.verifiers added later: a stored agent config without it reads as null and hashes as before."""
    import yaml

    from pipeline import config as config_mod
    from test_config import MINIMAL

    tree = yaml.safe_load(yaml.safe_dump(MINIMAL))
    tree.setdefault("rollout", {})["agent"] = {"command": ["python", "agent.py"]}
    cfg = config_mod.from_yaml_text(yaml.safe_dump(tree), "config.yaml")
    assert cfg.rollout.agent.verifiers is None and cfg.rollout.agent.command == ["python", "agent.py"]
    assert '"verifiers"' not in config_mod.canonical(cfg)
    with_vf = config_mod.resolve({**tree, "rollout": {**tree["rollout"], "agent": {"verifiers": {"taskset": "addition_v1"}}}})
    assert '"verifiers"' in config_mod.canonical(with_vf)


@needs_vf
@pytest.mark.parametrize("over, message", [
    ({"taskset": "no_such_taskset_xyz"}, "rollout.agent.verifiers.taskset 'no_such_taskset_xyz' does not import"),
    ({"taskset": "json"}, "rollout.agent.verifiers.taskset 'json': taskset module 'json' exports no Taskset subclass via `__all__`"),
    ({"env": "best_of_n"}, "rollout.agent.verifiers.env 'best_of_n': BestOfNEnv is not verifiers' SingleAgentEnv"),
    # r63b: a tool parser but a chat template without tools (the tiny model's, SmolLM2's): the schemas never reach the prompt
    ({"client": "train", "harness": "bash", "renderer": {"name": "default", "tool_parser": "qwen3"}},
     "the episode has tools (harness 'bash') and the renderer DefaultRenderer renders no tool schemas for"),
])
def test_a_taskset_that_does_not_import_or_exports_no_taskset_is_refused(assets, tmp_path, capsys, over, message):
    cfg = vf_config(assets, addition_rows(tmp_path / "rows.jsonl"), **over)
    line = init_error_line(capsys, tmp_path / "run", "--config", write_config(tmp_path / "cfg.yaml", cfg))
    assert message in line, line


def rollout_rows(run: Path, stage: str = "rollout") -> list[dict]:
    import pyarrow.parquet as pq

    return [r for p in sorted((Path(run) / f"iter-0000/{stage}").glob("part-*.parquet")) for r in pq.read_table(p).to_pylist()]


def iterated(assets, tmp: Path, n: int = 2, **over) -> list[Path]:
    """n runs of one config through `grpo init` and `grpo iterate --iters 1`."""
    from conftest import grpo

    conf = write_config(tmp / "cfg.yaml", vf_config(assets, addition_rows(tmp / "rows.jsonl"), **over))
    runs = [tmp / name for name in "ab"[:n]]
    for run in runs:
        grpo("init", str(run), "--config", str(conf))
        grpo("iterate", str(run), "--iters", "1", timeout=900)
    return runs


@pytest.fixture(scope="module")
def chat_runs(assets, tmp_path_factory) -> list[Path]:
    """Two runs of the Addition taskset on the chat route (verifiers' eval client): shared by the tests below."""
    return iterated(assets, tmp_path_factory.mktemp("vf_chat"))


@pytest.fixture(scope="module")
def train_runs(assets, tmp_path_factory) -> list[Path]:
    """Two runs of the Addition taskset on the tokens route (verifiers' train client): shared."""
    return iterated(assets, tmp_path_factory.mktemp("vf_train"), client="train")


@needs_vf
@pytest.mark.slow
def test_addition_taskset_through_grpo_iterate(chat_runs):
    """Two runs of one config through `grpo iterate`, each episode one verifiers `run_episode` (the null
    harness's chat program, through verifiers' interception server and eval client, to grpo's endpoint):
    the record holds the canonical trace, its reward is the column reward_vf_exact_match (weight 1, as
    verifiers weighs it) and is the taskset's own rule on the trace; mask 1 exactly on the sampled ids;
    the two runs' rollout and score parts are byte-identical."""
    runs = chat_runs
    import yaml

    rewards = yaml.safe_load((runs[0] / "config.yaml").read_text())["rewards"]
    assert [(r["name"], r["weight"], r.get("kwargs")) for r in rewards] == [
        ("vf_exact_match", 1.0, {"reward": "exact_match"}), ("agent", 0.0, {})]  # agent: logged only (Trace.reward)
    for stage in ("rollout", "score"):
        a, b = (sorted((r / f"iter-0000/{stage}").glob("part-*.parquet")) for r in runs)
        assert a and [p.read_bytes() for p in a] == [p.read_bytes() for p in b], stage
    scored = {(r["prompt_id"], r["sample_idx"]): r for r in rollout_rows(runs[0], "score")}
    rows = rollout_rows(runs[0])
    assert len(rows) == 4
    for row in rows:
        rec = json.loads(row["episode"])
        assert rec["route"] == "endpoint" and rec["agent"]["exit_code"] == 0 and rec["ending"] == "finished", rec
        turns = [q for q in rec["requests"] if q["kind"] == "turn"]
        assert turns and all(q["kind"] == "turn" for q in rec["requests"])  # the null harness makes no side call
        mask = [m for q in turns for m in [0] * len(q.get("prompt_delta", [])) + [1] * len(q["completion_ids"])]
        assert row["completion_mask"] == mask
        assert [t for t, m in zip(row["completion_ids"], mask) if m] == [t for q in turns for t in q["completion_ids"]]
        vf = rec["agent"]["result"]["verifiers"]
        trace = vf["trace"]
        assert vf["traces"] == 1 and vf["task"]["key"] and vf["task"]["hash"], vf
        assert trace["branches"] == 1 and rec["agent"]["trace_problem"] is None  # the trace is the record's conversation
        assert "id" not in trace and "timing" not in trace
        said = [m for m in trace["messages"] if m["role"] == "assistant"]
        assert [m.get("content") for m in said] == [q["message"]["content"] for q in turns]  # what grpo answered
        answer = 2 * row["vf_task"]  # the taskset's own rule (exact_match), applied to the trace's last reply
        want = float((said[-1].get("content") or "") == str(answer))
        assert trace["rewards"] == {"exact_match": {"score": want, "weight": 1.0}}
        assert rec["agent"]["result"]["reward"] == trace["reward"] == want
        got = scored[(row["prompt_id"], row["sample_idx"])]
        assert got["reward_vf_exact_match"] == got["reward_agent"] == got["reward"] == want


def test_the_eval_and_rollout_start_a_verifiers_agent_with_grpo_s_program():
    """rollout.agent.verifiers has no `command`: the program both stages start is vf_episode.py with the
    options (eval used to read rollout.agent.command[0] and raised TypeError on a verifiers run)."""
    from pipeline.agents.endpoint.vf_run import PROGRAM, options_json, run_argv
    from pipeline.config.agents import AgentCommand

    agent = AgentCommand(verifiers={"taskset": "addition_v1", "python": "python"})
    assert run_argv(agent, str) == ["python", PROGRAM, "--config", options_json(agent.verifiers)]
    copies = {"agent.py": "RUN/code/agent.py"}.get
    assert run_argv(AgentCommand(command=["python", "agent.py", "--no-nudge"]), lambda a: copies(a, a)) == \
        ["python", "RUN/code/agent.py", "--no-nudge"]


@needs_vf
@pytest.mark.slow
def test_addition_taskset_through_grpo_iterate_with_verifiers_train_client(train_runs):
    """rollout.agent.verifiers.client train: verifiers' train client renders the token ids itself (its
    renderers package, the tokenizer grpo names in GRPO_TOKENIZER) and POSTs them to grpo's tokens route
    (/inference/v1/generate); every turn is recorded on that route, mask 1 exactly on the engine's
    sampled ids, the trace's reply is the sampled ids' text, and two runs' parts are byte-identical."""
    runs = train_runs
    for stage in ("rollout", "score"):
        a, b = (sorted((r / f"iter-0000/{stage}").glob("part-*.parquet")) for r in runs)
        assert a and [p.read_bytes() for p in a] == [p.read_bytes() for p in b], stage
    rows = rollout_rows(runs[0])
    assert len(rows) == 4
    for row in rows:
        rec = json.loads(row["episode"])
        assert rec["agent"]["exit_code"] == 0 and rec["ending"] == "finished", rec
        turns = [q for q in rec["requests"] if q["kind"] == "turn"]
        assert turns and all(q["route"] == "tokens" for q in turns)
        assert turns[0]["asked"]["sampling_params"]["logprobs"] == 1  # what the train client asks, beside what was used
        mask = [m for q in turns for m in [0] * len(q.get("prompt_delta", [])) + [1] * len(q["completion_ids"])]
        assert row["completion_mask"] == mask
        assert [t for t, m in zip(row["completion_ids"], mask) if m] == [t for q in turns for t in q["completion_ids"]]
        trace = rec["agent"]["result"]["verifiers"]["trace"]
        assert trace is not None and trace["rewards"]["exact_match"]["weight"] == 1.0, rec["agent"]
        assert trace["sampled_ids"] == [q["completion_ids"] for q in turns]  # verifiers' own ids of its sampled nodes
        assert rec["agent"]["trace_problem"] is None


@pytest.fixture(scope="module")
def runtime_run(assets, tmp_path_factory) -> Path:
    """One run of the runtime_reward_v1 taskset (exact_match reads the trace; runtime_alive the runtime)."""
    return iterated(assets, tmp_path_factory.mktemp("vf_runtime"), n=1, taskset="runtime_reward_v1", path=RUNTIME_FIXTURE)[0]


def score_rows(run: Path) -> list[dict]:
    return rollout_rows(run, "score")


@needs_vf
@pytest.mark.slow
def test_replay_rescores_through_task_score_with_no_harness_engine_or_endpoint(chat_runs, runtime_run, tmp_path, monkeypatch, capsys):
    """`grpo replay --until score` of a verifiers run re-scores its trace rewards through verifiers' own
    Task.score(trace, runtime=None): one scoring process per score part and nothing else started (no
    engine, no agent process, no endpoint server: real constructions, counted on the way through); a
    reward that reads the runtime keeps its recorded score, is named in a printed line and marked
    `recorded` in extra_vf_<name>_replay."""
    import subprocess

    from pipeline.agents.endpoint import vf_run
    from pipeline.agents.endpoint.process import AgentProcess
    from pipeline.agents.endpoint.server import Server
    from pipeline.loop.replay import replay
    from pipeline.models.hf_engine import HFEngine
    from pipeline.models.vllm_engine import VLLMEngine
    from pipeline.run.run import Run

    started = {"engines": 0, "agents": 0, "servers": 0}
    commands: list[list[str]] = []

    def counted(cls, what):
        init = cls.__init__

        def counting(self, *args, **kwargs):
            if what == "processes":
                commands.append(list(args[0] if args else kwargs["args"]))
            else:
                started[what] += 1
            init(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__init__", counting)

    for cls, what in ((HFEngine, "engines"), (VLLMEngine, "engines"), (AgentProcess, "agents"), (Server, "servers"),
                      (subprocess.Popen, "processes")):
        counted(cls, what)
    for src in (chat_runs[0], runtime_run):
        commands.clear()
        new = Path(replay(str(src), 0, str(tmp_path / src.parent.name), until="score").uri)
        parts = sorted((new / "iter-0000/score").glob("part-*.parquet"))
        assert started == {"engines": 0, "agents": 0, "servers": 0}
        started_here = [c for c in commands if c[0] != "git"]  # git: `git describe`, grpo's own version stamp
        assert parts and len(started_here) == len(parts), commands  # one scoring process per part, nothing else
        assert all(c[1] == vf_run.PROGRAM and c[-1] == "--score" for c in started_here), commands
        old = {(r["prompt_id"], r["sample_idx"]): r for r in score_rows(src)}
        for row, rec in zip(score_rows(new), rollout_rows(new)):
            trace = json.loads(rec["episode"])["agent"]["result"]["verifiers"]["trace"]
            said = [m for m in trace["messages"] if m["role"] == "assistant"]
            rule = float((said[-1].get("content") or "").strip() == str(2 * rec["vf_task"]))  # the taskset's own rule
            was = old[(row["prompt_id"], row["sample_idx"])]
            assert row["reward_vf_exact_match"] == rule == was["reward_vf_exact_match"]
            assert row["extra_vf_exact_match_replay"] == "rescored"
            if src == runtime_run:  # read the runtime: the recorded score, kept and marked
                assert row["reward_vf_runtime_alive"] == was["reward_vf_runtime_alive"] == 1.0
                assert row["extra_vf_runtime_alive_replay"] == "recorded"
                assert row["reward"] == was["reward"] == rule + 0.5
            else:
                assert "extra_vf_runtime_alive_replay" not in row
    out = capsys.readouterr().out
    assert [ln for ln in out.splitlines() if "not replayable" in ln] == [
        "grpo: replay: the verifiers reward 'runtime_alive' reads the runtime (no runtime runs in a replay): not replayable, "
        "its recorded score is kept (column extra_vf_runtime_alive_replay)"] * len(parts)
    # it re-scores the trace, never copies the recorded score: a recorded score forged to the wrong value comes
    # back right, and a trace whose last reply is the right answer scores 1 (the tiny model's replies never are)
    opts = Run(str(chat_runs[0])).cfg.rollout.agent.verifiers
    row = rollout_rows(chat_runs[0])[0]
    forged, solved = (json.loads(row["episode"])["agent"]["result"] for _ in range(2))
    right = forged["verifiers"]["trace"]["rewards"]["exact_match"]["score"]
    forged["verifiers"]["trace"]["rewards"]["exact_match"]["score"] = 1.0 - right
    [m for m in solved["verifiers"]["trace"]["messages"] if m["role"] == "assistant"][-1]["content"] = str(2 * row["vf_task"])
    commands.clear()
    got = vf_run.rescore(opts, [forged, solved, None], [row["vf_task"], row["vf_task"], None])
    assert [g and g["verifiers"]["trace"]["rewards"]["exact_match"]["score"] for g in got] == [right, 1.0, None]
    assert [c[-1] for c in commands] == ["--score"]


@needs_vf
@pytest.mark.slow
def test_audit_of_a_verifiers_run_catches_a_forged_token_and_a_forged_trace(chat_runs, train_runs):
    """`grpo audit` of verifiers runs on both routes is clean; a forged token, a forged trace (its reply
    not what grpo sampled), a second branch and a fake trace_problem are each named in one line."""
    from pipeline.agents.endpoint.audit import row_problems as endpoint_problems
    from pipeline.report.audit import audit_run
    from pipeline.rollout import RolloutInputs
    from pipeline.run.run import Run

    for run in (chat_runs[0], train_runs[0]):
        audited = audit_run(Run(run))
        assert audited.problems == [] and audited.unchecked_episodes == 0, audited.problems
        inputs = RolloutInputs(Run(run), 0)

        def check(r):
            return endpoint_problems(inputs.episodes, r, inputs.group_seed(r["prompt_id"]))

        rows = rollout_rows(run)
        assert all(check(r) == [] for r in rows)
        row = rows[0]
        ids = list(row["completion_ids"])
        i = len(ids) - 1 - row["completion_mask"][::-1].index(1)  # the last sampled token
        ids[i] ^= 1
        found = check({**row, "completion_ids": ids})
        assert len(found) == 1 and "recorded completion ids" in found[0], found

        def forged(edit) -> list[str]:
            rec = json.loads(row["episode"])
            edit(rec, rec["agent"]["result"]["verifiers"]["trace"])
            return check({**row, "episode": json.dumps(rec)})

        def reply(rec, trace):  # what verifiers scored is not what grpo sampled
            if "sampled_ids" in trace:
                trace["sampled_ids"][-1][-1] ^= 1
            else:
                said = [m for m in trace["messages"] if m["role"] == "assistant"][-1]
                said["content"] = (said.get("content") or "") + " 42"

        found = forged(reply)
        assert len(found) == 1 and "no trace_problem says so" in found[0] and "rewrote the history" in found[0], found
        assert forged(lambda rec, t: t.update(branches=2)) == [
            "its verifiers trace disagrees with its record and no trace_problem says so "
            "(the verifiers trace has 2 branches; grpo's record holds one conversation)"]
        assert forged(lambda rec, t: rec["agent"].update(trace_problem="made up")) == [
            "its trace_problem ('made up') is not what its trace and record give (they agree)"]


@needs_vf
def test_a_taskset_importing_and_running_its_sibling_modules_loads_from_its_path():
    """Reviewer F4: verifiers' own environments import sibling modules of their folder (environments/scratchpad), and
    the subprocess runtime's processes inherit the episode's environment. vf_episode puts rollout.agent.verifiers.path
    (relative: read from the directory grpo runs in) on sys.path and on the children's PYTHONPATH: the fixture imports
    its sibling and runs it as `python -m` to build its tasks."""
    here = REPO / "tests/fixtures/verifiers"
    cfg = json.dumps({"taskset": "sibling_v1", "path": "sibling_v1", "harness": "null", "runtime": "subprocess"})
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([VF, str(REPO / "pipeline/agents/endpoint/vf_episode.py"), "--check", "--config", cfg],
                         capture_output=True, text=True, cwd=here, env=env, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1]) == {"rewards": {"exact_sum": 0.5}}


@pytest.mark.slow  # SmolLM2's GGUF is fetched and converted once per machine
@needs_vf
def test_the_init_check_of_a_gguf_model_builds_the_renderer_from_its_converted_folder(smollm2):
    """`grpo init`'s check (vf_run.check) with client train builds verifiers' renderer for the run's tokenizer: for a
    GGUF model that is its converted folder (as the run loads its tokenizer, run.model_source), not the .gguf file."""
    from pipeline.agents.endpoint.vf_run import check
    from pipeline.config.agents import VerifiersOptions

    assert check(VerifiersOptions(**vf_options(client="train")), smollm2["gguf"]) == {"exact_match": 1.0}


@needs_vf
def test_replay_keeps_the_recorded_scores_of_a_trace_whose_rollout_errored(capsys):
    """r63b's finding: verifiers' replay skips a trace whose rollout errored (`ok` false: a harness that
    crashed, a reward that raised) and records a scoring error per trace; grpo's re-scored such a trace
    from its partial messages (a reward None at rollout came back a number), and one reward raising in
    the replay failed the whole `grpo replay`. Now its recorded scores are kept, a line names it."""
    from pipeline.agents.endpoint.vf_run import rescore, trace_reward
    from pipeline.config.agents import AgentCommand

    opts = AgentCommand(verifiers=vf_options()).verifiers
    said = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]
    traces = [{"messages": said, "rewards": {"exact_match": None}, "ok": False, "stop_condition": "harness_error"},
              {"messages": said, "rewards": {"exact_match": {"score": 0.0, "weight": 1.0}}, "ok": True, "stop_condition": "agent_completed"}]
    out = rescore(opts, [{"verifiers": {"trace": t}} for t in traces], [2, 2])
    errored, fine = (r["verifiers"] for r in out)
    assert errored["trace"]["rewards"] == {"exact_match": None}  # kept: verifiers' replay does not re-score it
    assert errored["replay"] == {"rescored": [], "recorded": ["exact_match"], "skipped": "its rollout errored (verifiers' replay skips it)"}
    assert fine["trace"]["rewards"] == {"exact_match": {"score": 1.0, "weight": 1.0}} and fine["replay"]["rescored"] == ["exact_match"]
    assert "(vf_task 2) is not re-scored, its rollout errored" in capsys.readouterr().out
    logged = {}
    crashed = {"verifiers": {"trace": {"rewards": {}}, "replay": {"rescored": [], "recorded": [], "skipped": "its rollout errored"}}}
    assert trace_reward([None] * 3, [*out, crashed], reward="exact_match", log_extra=logged.__setitem__) == [None, 1.0, None]
    assert logged == {"vf_exact_match_replay": ["recorded", "rescored", "recorded"]}  # a harness crash records no score at all


def test_a_trace_with_no_branch_agrees_with_a_record_whose_first_request_was_refused():
    """r63b's finding: an episode whose first request grpo refused (prompt_too_long: verifiers' own
    glossary environment's tool schemas on the tiny model) has a trace with no branch and a record with
    no turn; trace_problem called that a disagreement ("0 branches"). A trace with turns grpo has not
    answered still disagrees."""
    from pipeline.agents.endpoint.vf_trace import problem

    refused = [{"kind": "refused", "body_sha256": "x", "why": "610 tokens, more than the 416 ..."}]
    assert problem(refused, {"trace": {"messages": [], "branches": 0}}) is None
    said = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}]
    assert problem(refused, {"trace": {"messages": said, "branches": 1}}) == \
        "the verifiers trace holds 1 assistant message(s), grpo's record 0 turn(s)"
    assert "has 2 branches" in problem(refused, {"trace": {"messages": said, "branches": 2}})


def test_what_verifiers_recorded_as_going_wrong_is_one_log_line():
    """r63b's finding: a harness program that crashed, a reward that raised or a tool server that failed
    to start is recorded in the trace's errors alone: the row ends finished (or length, no_calls), is
    trained at reward 0 and nothing in `grpo iterate`'s output said so. The runner now prints this line."""
    from pipeline.agents.endpoint.vf_trace import errors

    assert errors({"episode_errors": [], "trace": {"errors": []}}) is None and errors({"trace": None, "episode_errors": []}) is None
    vf = {"episode_errors": [{"type": "EnvError", "message": "\nthe env broke"}],
          "trace": {"errors": [{"type": "TaskError", "message": "task BreakTask scoring: RuntimeError: raises\nmore"}]}}
    assert errors(vf) == "EnvError: the env broke; TaskError: task BreakTask scoring: RuntimeError: raises"
