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
])
def test_a_taskset_that_does_not_import_or_exports_no_taskset_is_refused(assets, tmp_path, capsys, over, message):
    cfg = vf_config(assets, addition_rows(tmp_path / "rows.jsonl"), **over)
    line = init_error_line(capsys, tmp_path / "run", "--config", write_config(tmp_path / "cfg.yaml", cfg))
    assert message in line, line


def rollout_rows(run: Path, stage: str = "rollout") -> list[dict]:
    import pyarrow.parquet as pq

    return [r for p in sorted((Path(run) / f"iter-0000/{stage}").glob("part-*.parquet")) for r in pq.read_table(p).to_pylist()]


@needs_vf
@pytest.mark.slow
def test_addition_taskset_through_grpo_iterate(assets, tmp_path):
    """Two runs of one config through `grpo iterate`, each episode one verifiers `run_episode` (the null
    harness's chat program, through verifiers' interception server and eval client, to grpo's endpoint):
    the record holds the canonical trace, its reward is the column reward_vf_exact_match (weight 1, as
    verifiers weighs it) and is the taskset's own rule on the trace; mask 1 exactly on the sampled ids;
    the two runs' rollout and score parts are byte-identical."""
    from conftest import grpo

    cfg = vf_config(assets, addition_rows(tmp_path / "rows.jsonl"))
    conf = write_config(tmp_path / "cfg.yaml", cfg)
    runs = [tmp_path / "a", tmp_path / "b"]
    for run in runs:
        grpo("init", str(run), "--config", str(conf))
        grpo("iterate", str(run), "--iters", "1", timeout=900)
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
def test_addition_taskset_through_grpo_iterate_with_verifiers_train_client(assets, tmp_path):
    """rollout.agent.verifiers.client train: verifiers' train client renders the token ids itself (its
    renderers package, the tokenizer grpo names in GRPO_TOKENIZER) and POSTs them to grpo's tokens route
    (/inference/v1/generate); every turn is recorded on that route, mask 1 exactly on the engine's
    sampled ids, the trace's reply is the sampled ids' text, and two runs' parts are byte-identical."""
    from conftest import grpo

    cfg = vf_config(assets, addition_rows(tmp_path / "rows.jsonl"), client="train")
    conf = write_config(tmp_path / "cfg.yaml", cfg)
    runs = [tmp_path / "a", tmp_path / "b"]
    for run in runs:
        grpo("init", str(run), "--config", str(conf))
        grpo("iterate", str(run), "--iters", "1", timeout=900)
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
