"""The GitHub Actions workflows in workflows/: actionlint, their shape, and their run steps
executed here, in order, against a tiny local run.

The executor reads the YAML the way the runner does for what these workflows use: jobs in
`needs` order, a matrix expanded into one job per value, workflow and job `env` with their
`${{ }}` expressions (contexts inputs, vars, secrets, needs, matrix, steps, github, runner),
`run:` steps under `bash --noprofile --norc -eo pipefail`, and step outputs through
$GITHUB_OUTPUT. `uses:` steps (checkout, setup-python, upload-artifact) and the `install`
step are the runner's business and are skipped: the test's environment has grpo installed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO, base_config, write_config

WORKFLOWS = REPO / "workflows"
FILES = ("grpo-iterate.yml", "grpo-sharded.yml")
BIN = Path(sys.executable).parent


def load(name: str) -> dict:
    wf = yaml.safe_load((WORKFLOWS / name).read_text())
    wf["on"] = wf.pop(True, wf.get("on"))  # YAML 1.1 reads the key `on` as true
    return wf


def test_workflows_pass_actionlint():
    proc = subprocess.run([str(BIN / "actionlint"), *(str(WORKFLOWS / f) for f in FILES)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_workflows_take_a_run_and_never_overlap_on_it():
    iterate, sharded = load(FILES[0]), load(FILES[1])
    for wf in (iterate, sharded):
        assert wf["on"]["schedule"] and {"run_uri", "config"} <= set(wf["on"]["workflow_dispatch"]["inputs"])
        assert wf["concurrency"]["cancel-in-progress"] is False
        assert "GRPO_RUN_URI" in wf["concurrency"]["group"] and "inputs.run_uri" in wf["concurrency"]["group"]
    assert iterate["concurrency"]["group"] == sharded["concurrency"]["group"]  # one group per run, across both
    assert "shards" in sharded["on"]["workflow_dispatch"]["inputs"]
    jobs = sharded["jobs"]
    assert "matrix" in jobs["rollout"]["strategy"] and jobs["update"]["needs"] == ["plan", "score", "logprobs"]


# ------------------------------------------------------------------------------ the executor

EXPR = re.compile(r"\$\{\{\s*(.*?)\s*\}\}")


def evaluate(expr: str, ctx: dict):
    """The expressions these workflows use: `a || b || 'literal'`, dotted context paths, fromJSON()."""
    for term in (t.strip() for t in expr.split("||")):
        if term.startswith("fromJSON(") and term.endswith(")"):
            value = json.loads(evaluate(term[9:-1], ctx))
        elif term.startswith("'") and term.endswith("'"):
            value = term[1:-1]
        else:
            value = ctx
            for key in term.split("."):
                value = value.get(key, "") if isinstance(value, dict) else ""
        if value not in ("", None):
            return value
    return ""


def expand(value, ctx: dict):
    if not isinstance(value, str):
        return value
    whole = EXPR.fullmatch(value.strip())
    if whole:
        return evaluate(whole.group(1), ctx)
    return EXPR.sub(lambda m: str(evaluate(m.group(1), ctx)), value)


def job_order(jobs: dict) -> list[str]:
    order: list[str] = []
    while len(order) < len(jobs):
        for name, job in jobs.items():
            needs = job.get("needs", [])
            needs = [needs] if isinstance(needs, str) else needs
            if name not in order and all(n in order for n in needs):
                order.append(name)
    return order


def run_workflow(name: str, inputs: dict, base_env: dict, temp: Path) -> dict:
    """Run a workflow's steps here; returns {"outputs": job outputs, "skipped": skipped steps, "logs": ...}."""
    wf = load(name)
    ctx = {"inputs": inputs, "vars": {}, "secrets": {}, "github": {"run_id": "1"}, "runner": {"temp": str(temp)}}
    outputs, skipped, logs = {}, [], []
    for job_name in job_order(wf["jobs"]):
        job = wf["jobs"][job_name]
        needs = job.get("needs", [])
        jctx = {**ctx, "needs": {n: {"outputs": outputs[n]} for n in ([needs] if isinstance(needs, str) else needs)}}
        matrix = job.get("strategy", {}).get("matrix", {})
        combos = [{}]
        for key, values in matrix.items():
            combos = [{**c, key: v} for c in combos for v in expand(values, jctx)]
        for combo in combos:
            mctx = {**jctx, "matrix": combo, "steps": {}}
            env = {**base_env, **{k: str(expand(v, mctx)) for k, v in wf.get("env", {}).items()}}
            env.update({k: str(expand(v, mctx)) for k, v in job.get("env", {}).items()})
            for i, step in enumerate(job["steps"]):
                if "uses" in step or step.get("id") == "install":
                    skipped.append(step.get("uses") or step["id"])
                    continue
                out_file = temp / f"output-{job_name}-{len(logs)}-{i}"
                out_file.write_text("")
                proc = subprocess.run(
                    ["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", step["run"]],
                    cwd=REPO, env={**env, "GITHUB_OUTPUT": str(out_file)}, capture_output=True, text=True, timeout=900,
                )
                logs.append((job_name, combo, step.get("name"), proc.stdout, proc.stderr))
                assert proc.returncode == 0, f"{name} job {job_name} {combo} step {step.get('name')!r}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
                if "id" in step:
                    lines = [line.split("=", 1) for line in out_file.read_text().splitlines() if "=" in line]
                    mctx["steps"][step["id"]] = {"outputs": dict(lines)}
            outputs[job_name] = {k: expand(v, mctx) for k, v in job.get("outputs", {}).items()}
    return {"outputs": outputs, "skipped": skipped, "logs": logs}


@pytest.mark.slow
def test_workflow_steps_move_a_tiny_run_forward(assets, tmp_path):
    """The sharded workflow creates the run and does iteration 0 with 2 rollout shards as
    separate jobs; the scheduled workflow then adds iteration 1."""
    cfg = write_config(tmp_path / "cfg.yaml", base_config(assets, rollout={"engine": "hf", "max_new_tokens": 16, "groups_per_part": 1}))
    run = tmp_path / "run"
    temp = tmp_path / "runner-temp"
    temp.mkdir()
    summary = tmp_path / "summary.md"
    base_env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "RUNNER_TEMP": str(temp),
        "GITHUB_STEP_SUMMARY": str(summary),
        "OMP_NUM_THREADS": "1",
    }
    inputs = {"run_uri": str(run), "config": str(cfg), "shards": "2"}

    sharded = run_workflow("grpo-sharded.yml", inputs, base_env, temp)
    assert sharded["outputs"]["plan"] == {"iteration": "0", "shards": "[0, 1]"}
    rollout_jobs = [log for log in sharded["logs"] if log[0] == "rollout"]
    assert [log[1] for log in rollout_jobs] == [{"shard": 0}, {"shard": 1}]
    assert "manifest follows" in rollout_jobs[0][3] and "rollout iteration 0: done" in rollout_jobs[1][3]
    assert set(sharded["skipped"]) == {"actions/checkout@v4", "actions/setup-python@v5", "install", "actions/upload-artifact@v4"}
    rollout = json.loads((run / "iter-0000/rollout/MANIFEST.json").read_text())
    assert sorted(rollout["outputs"]) == [f"part-{p:05d}.parquet" for p in range(4)]
    assert json.loads((temp / "grpo-status.json").read_text())["completed"] == 1

    iterate = run_workflow("grpo-iterate.yml", {"run_uri": str(run)}, base_env, temp)
    assert any("1 iterations done" in log[3] for log in iterate["logs"])  # the restore step found the run
    status = json.loads((temp / "grpo-status.json").read_text())
    assert status["completed"] == 2
    assert (run / "policy/iter-0002/MANIFEST.json").is_file()
    text = summary.read_text()  # one markdown table per report step
    assert f"### {run}: 1 iterations done" in text and f"### {run}: 2 iterations done" in text
    assert "| 1 | rollout, score, logprobs, update |" in text
