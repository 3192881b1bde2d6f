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


@needs_vf
@pytest.mark.parametrize("over, message", [
    ({"taskset": "no_such_taskset_xyz"}, "rollout.agent.verifiers.taskset 'no_such_taskset_xyz' does not import"),
    ({"taskset": "json"}, "rollout.agent.verifiers.taskset 'json': taskset module 'json' exports no Taskset subclass via `__all__`"),
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
    """Two runs of one config through `grpo iterate`: each episode one verifiers `run_episode`."""
    from conftest import grpo

    cfg = vf_config(assets, addition_rows(tmp_path / "rows.jsonl"))
    conf = write_config(tmp_path / "cfg.yaml", cfg)
    runs = [tmp_path / "a", tmp_path / "b"]
    for run in runs:
        out = grpo("init", str(run), "--config", str(conf))
        assert "vf_exact_match" in (run / "config.yaml").read_text(), out.stdout
        grpo("iterate", str(run), "--iters", "1", timeout=900)
    rows = rollout_rows(runs[0])
    assert len(rows) == 4
    for row in rows:
        rec = json.loads(row["episode"])
        print(json.dumps(rec, indent=1)[:4000])
        assert rec["route"] == "endpoint" and rec["agent"]["exit_code"] == 0, rec
