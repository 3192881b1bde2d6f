"""The GitHub Actions workflows in workflows/: actionlint, their shape, and their run steps
executed here, in order, against a tiny local run.

The executor reads the YAML the way the runner does for what these workflows use: jobs in
`needs` order (the jobs whose needs are met side by side), a matrix expanded into one job per
value, workflow and job `env` with their
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
import threading
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


def waves(jobs: dict) -> list[list[str]]:
    """Jobs grouped as the runner starts them: each wave needs only jobs of earlier waves."""
    done: list[str] = []
    out = []
    while len(done) < len(jobs):
        ready = [n for n, job in jobs.items() if n not in done and all(d in done for d in needs_of(job))]
        out.append(ready)
        done += ready
    return out


def needs_of(job: dict) -> list[str]:
    needs = job.get("needs", [])
    return [needs] if isinstance(needs, str) else needs


def run_job(wf: dict, job_name: str, mctx: dict, base_env: dict, temp: Path, skipped: list, logs: list) -> None:
    """One job (one matrix value): its steps in order, each in a fresh bash, outputs via $GITHUB_OUTPUT."""
    job = wf["jobs"][job_name]
    env = {**base_env, **{k: str(expand(v, mctx)) for k, v in wf.get("env", {}).items()}}
    env.update({k: str(expand(v, mctx)) for k, v in job.get("env", {}).items()})
    tag = "-".join([job_name, *map(str, mctx["matrix"].values())])
    for i, step in enumerate(job["steps"]):
        if "uses" in step or step.get("id") == "install":
            skipped.append(step.get("uses") or step["id"])
            continue
        out_file = temp / f"output-{tag}-{i}"
        out_file.write_text("")
        proc = subprocess.run(
            ["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", step["run"]],
            cwd=REPO, env={**env, "GITHUB_OUTPUT": str(out_file)}, capture_output=True, text=True, timeout=900,
        )
        logs.append((job_name, mctx["matrix"], step.get("name"), proc.stdout, proc.stderr, proc.returncode))
        if proc.returncode != 0:
            return  # later steps of a failed job do not run; the caller reports it
        if "id" in step:
            lines = [line.split("=", 1) for line in out_file.read_text().splitlines() if "=" in line]
            mctx["steps"][step["id"]] = {"outputs": dict(lines)}


def run_workflow(name: str, inputs: dict, base_env: dict, temp: Path) -> dict:
    """Run a workflow's steps here; returns {"outputs": job outputs, "skipped": skipped steps,
    "logs": (job, matrix, step, stdout, stderr, returncode) per step run}. The jobs of a wave,
    matrix values included, run side by side as on GitHub."""
    wf = load(name)
    ctx = {"inputs": inputs, "vars": {}, "secrets": {}, "github": {"run_id": "1"}, "runner": {"temp": str(temp)}}
    outputs, skipped, logs = {}, [], []
    for wave in waves(wf["jobs"]):
        instances = []
        for job_name in wave:
            job = wf["jobs"][job_name]
            jctx = {**ctx, "needs": {n: {"outputs": outputs[n]} for n in needs_of(job)}}
            combos = [{}]
            for key, values in job.get("strategy", {}).get("matrix", {}).items():
                combos = [{**c, key: v} for c in combos for v in expand(values, jctx)]
            instances += [(job_name, {**jctx, "matrix": combo, "steps": {}}) for combo in combos]
        threads = [threading.Thread(target=run_job, args=(wf, n, m, base_env, temp, skipped, logs)) for n, m in instances]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = [log for log in logs if log[5] != 0]
        assert not failed, "\n".join(f"{name} job {f[0]} {f[1]} step {f[2]!r}:\n{f[3][-3000:]}\n{f[4][-3000:]}" for f in failed)
        for job_name, mctx in instances:
            outputs[job_name] = {k: expand(v, mctx) for k, v in wf["jobs"][job_name].get("outputs", {}).items()}
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
    rollout_jobs = sorted((log for log in sharded["logs"] if log[0] == "rollout"), key=lambda log: log[1]["shard"])
    assert [log[1] for log in rollout_jobs] == [{"shard": 0}, {"shard": 1}]  # two parallel jobs
    assert any("rollout iteration 0: done" in log[3] for log in rollout_jobs)  # the last one wrote the manifest
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
