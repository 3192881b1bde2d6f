"""Resumable: SIGKILL a stage anywhere, rerun the same command, and the run equals an
uninterrupted one; a second process on a stage that is being run fails with a clear message.

The kill points are hit exactly by the fault hook `GRPO_FAULT=<stage>:<point>[:<iteration>]`
(`pipeline.store.faults.fault_point`: the process SIGKILLs itself there, e.g. between a stage's last
part and its manifest), and once by the test itself at a moment it does not pick precisely
(while DeepSpeed writes the update's checkpoint).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, base_config, grpo, write_config
from test_reproduce import copy_run, first_difference, manifest, record, reference_run

pytestmark = pytest.mark.slow
KILLED = -signal.SIGKILL


def killed(*args: str, fault: str) -> None:
    out = grpo(*args, env={"GRPO_FAULT": fault}, check=False)
    assert out.returncode == KILLED, (args, fault, out.returncode, out.stderr[-3000:])


def killed_when(path: Path, *args: str, log: Path) -> None:
    """Run the CLI and SIGKILL it as soon as `path` appears."""
    with open(log, "wb") as err:  # a file, not a pipe: a full pipe would stall the process
        proc = subprocess.Popen([sys.executable, "-m", "stages.cli", *args], cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.time() + 600
        while not path.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == KILLED, f"exited {proc.returncode} before {path} appeared:\n{log.read_text()[-3000:]}"


def parts(run: Path, rel: str) -> list[str]:
    return sorted(p.name for p in (run / rel).glob("part-*.parquet"))


def done(run: Path, rel: str) -> bool:
    return (run / rel / "MANIFEST.json").exists()


def test_killed_at_every_point_then_rerun_equals_uninterrupted(assets, tmp_path_factory, tmp_path):
    from pipeline.report.audit import audit_run
    from pipeline.run.run import Run

    ref = reference_run(tmp_path_factory, assets)
    run = tmp_path / "run"
    R = str(run)
    grpo("init", R, "--config", str(write_config(tmp_path / "config.yaml", base_config(assets))))

    # rollout: after its first part, then between its last part and its manifest
    killed("rollout", R, fault="rollout:part")
    assert parts(run, "iter-0000/rollout") == ["part-00000.parquet"] and not done(run, "iter-0000/rollout")
    first = (run / "iter-0000/rollout/part-00000.parquet").stat()
    killed("rollout", R, fault="rollout:manifest")
    assert parts(run, "iter-0000/rollout") == ["part-00000.parquet", "part-00001.parquet"] and not done(run, "iter-0000/rollout")
    again = (run / "iter-0000/rollout/part-00000.parquet").stat()
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)  # kept, not sampled again
    grpo("rollout", R)  # only the manifest was missing
    assert done(run, "iter-0000/rollout")

    # score and logprobs: after a part and before the manifest; the last one inside iterate
    killed("score", R, fault="score:part")
    killed("score", R, fault="score:manifest")
    assert parts(run, "iter-0000/score") == ["part-00000.parquet", "part-00001.parquet"] and not done(run, "iter-0000/score")
    killed("logprobs", R, fault="logprobs:part")
    assert parts(run, "iter-0000/logprobs") == ["part-00000.parquet"]
    killed("iterate", R, "--iters", "2", fault="logprobs:manifest:0")
    assert done(run, "iter-0000/score") and not done(run, "iter-0000/logprobs")

    # update: while it writes its checkpoint, then after publishing policy 1
    killed_when(run / "iter-0000/update/.work", "iterate", R, "--iters", "2", log=tmp_path / "killed.log")
    assert done(run, "iter-0000/logprobs") and not done(run, "iter-0000/update")
    killed("update", R, fault="update:publish")
    assert done(run, "policy/iter-0001") and not done(run, "iter-0000/update")

    # iterate: update 0 done, killed while it writes its closing trainer state (no state 0 then:
    # update 1 below re-runs update 0 from its stored parts, its recorded policy hash checked)
    killed("iterate", R, "--iters", "1", fault="update:state:0")
    assert done(run, "iter-0000/update") and done(run, "policy/iter-0001") and not (run / "iter-0000/update/state").exists()

    # iterate: iteration 1's rollout before its manifest, then its update after publishing (policy 2's
    # record on its background thread), then in that thread before update 1's manifest, then after the
    # file, before the policy's MANIFEST.json
    killed("iterate", R, "--iters", "2", fault="rollout:manifest:1")
    assert done(run, "iter-0000/update") and parts(run, "iter-0001/rollout") == ["part-00000.parquet", "part-00001.parquet"]
    killed("iterate", R, "--iters", "2", fault="update:publish:1")
    assert not done(run, "iter-0001/update")
    # in the background write, policy 2 hashed and update 1's manifest not written: nothing names the
    # hash yet (rollout 2, running beside it, waits for the record before its first part)
    killed("iterate", R, "--iters", "3", fault="update:record:1")
    assert not done(run, "iter-0001/update") and parts(run, "iter-0002/rollout") == []
    killed("iterate", R, "--iters", "2", fault="update:write:1")
    assert done(run, "iter-0001/update") and not done(run, "policy/iter-0002")
    assert (run / "policy/iter-0002/model.safetensors").exists()  # the whole file, unconfirmed without its manifest

    # the resume re-runs update 1 and checks the hash it recorded: a tampered one stops it, naming iteration 1
    recorded_file = run / "iter-0001/update/MANIFEST.json"
    text, recorded = recorded_file.read_text(), manifest(run, "iter-0001/update")["policy_hash"]
    recorded_file.write_text(text.replace(recorded, "0" * 64))
    out = grpo("iterate", R, "--iters", "2", check=False)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith("error: update iteration 1: re-run from its stored parts") and recorded[:16] in lines[0]
    assert not done(run, "policy/iter-0002")
    recorded_file.write_text(text)
    grpo("iterate", R, "--iters", "2")
    assert (run / "iter-0001/update/state/trainer.json").exists()

    assert record(run) == record(ref), first_difference(run, ref)  # the same parts, metrics and policies (the update too)
    report = audit_run(Run(R))
    assert report.ok, report.problems
    assert report.skipped == []
    leftovers = [p for p in run.rglob("*") if p.name.startswith(".tmp-") or p.name == ".work"]
    assert leftovers == []
    for k in range(2):
        for stage in ("rollout", "score", "logprobs"):  # no part beyond the listed ones, no duplicated rows
            rel = f"iter-{k:04d}/{stage}"
            assert parts(run, rel) == sorted(manifest(run, rel)["outputs"]) == ["part-00000.parquet", "part-00001.parquet"]
            assert manifest(run, rel)["rows"] == 16

    # the same command once more: nothing to do, never a third iteration
    before = {p: p.stat().st_mtime_ns for p in run.rglob("MANIFEST.json")}
    grpo("iterate", R, "--iters", "2")
    assert {p: p.stat().st_mtime_ns for p in run.rglob("MANIFEST.json")} == before
    # (rollout 2 of the killed `--iters 3` may have taken its lock before the kill: nothing more)
    assert [p.name for p in run.glob("iter-0002/**/*") if p.is_file() and not p.name.startswith(".lock")] == []


def test_killed_in_the_background_write_keeps_the_state_before_and_evaluates_the_policy_after_resume(assets, tmp_path_factory, tmp_path):
    """A state after every update, one kept, an eval of every policy, weights to the engine in
    memory. Killed in `iterate`'s background write of policy 2 (update 1 recorded with its state,
    the policy's MANIFEST.json not written, policy 2 not evaluated): state 0 must still be there,
    so the resume re-runs update 1 alone, not every update from policy 0; and the resume must
    evaluate policy 2, which the loop (evaluating only the policies it makes) never asked for.
    Its policies then are the uninterrupted run's."""
    from pipeline.report.audit import audit_run
    from pipeline.run.run import Run

    ref = reference_run(tmp_path_factory, assets)
    run = tmp_path / "run"
    cfg = base_config(assets, rollout={"weight_sync": "memory"}, eval={"every": 1}, train={"state_every": 1, "keep_states": 1})
    grpo("init", str(run), "--config", str(write_config(tmp_path / "config.yaml", cfg)))
    killed("iterate", str(run), "--iters", "2", fault="update:write:1")
    assert done(run, "iter-0001/update") and not done(run, "policy/iter-0002") and not done(run, "iter-0002/eval")
    assert (run / "iter-0001/update/state/trainer.json").exists() and (run / "iter-0000/update/state/trainer.json").exists()

    grpo("iterate", str(run), "--iters", "2")
    assert all(done(run, f"iter-{k:04d}/eval") for k in range(3))
    assert not (run / "iter-0000/update/state").exists() and (run / "iter-0001/update/state/trainer.json").exists()
    # the parts name this config's hash; the policies, trained alike, are the reference run's bytes
    hashes = [[manifest(r, f"policy/iter-{k:04d}")["policy_hash"] for k in range(3)] for r in (run, ref)]
    assert hashes[0] == hashes[1]
    report = audit_run(Run(str(run)))
    assert report.ok, report.problems


def test_a_second_process_on_a_running_stage_fails_clearly(assets, tmp_path_factory, tmp_path):
    from pipeline.run.run import Run
    from pipeline.score import run_score

    ref = reference_run(tmp_path_factory, assets)
    run = copy_run(ref, tmp_path / "run")
    for rel in ("iter-0001/score", "iter-0001/update", "policy/iter-0002"):
        shutil.rmtree(run / rel)
    r = Run(str(run))

    # another process is writing iteration 1's score: a second one is refused, nothing written
    with r.store.lock("iter-0001/score/.lock-shard-0-of-1", "held by the test"):
        out = grpo("score", str(run), "--iter", "1", check=False)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"error: {run}/iter-0001/score/.lock-shard-0-of-1: another grpo process holds this lock "
        "(score iteration 1 shard 0/1); wait for it or stop it"
    ]
    assert parts(run, "iter-0001/score") == [] and not done(run, "iter-0001/score")

    run_score(r, 1)  # the first process finishes: exactly the uninterrupted run's parts
    assert manifest(run, "iter-0001/score")["outputs"] == manifest(ref, "iter-0001/score")["outputs"]

    with r.store.lock("iter-0001/update/.lock", "held by the test"):
        out = grpo("update", str(run), "--iter", "1", check=False)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"error: {run}/iter-0001/update/.lock: another grpo process holds this lock (update iteration 1); wait for it or stop it"
    ]
    assert not (run / "policy/iter-0002").exists() and not done(run, "iter-0001/update")
    assert os.listdir(run / "iter-0001/update") == [".lock"]


def test_a_resume_between_two_states_reruns_each_missing_update_and_checks_its_hash(assets, tmp_path_factory, tmp_path):
    """train.state_every (default 10): the reference run wrote no trainer state after update 0,
    only the one `iterate` writes at its end. Update 1 resumed in a new process has no state 0: it
    re-runs update 0 from its stored parts. A tampered recorded policy hash stops it with one line
    naming iteration 0 and nothing written; the true record lets it finish as the uninterrupted run.
    Then from the state `iterate` writes at its end, edited (one line) and as written (the same run)."""
    ref = reference_run(tmp_path_factory, assets)
    assert not (ref / "iter-0000/update/state").exists() and (ref / "iter-0001/update/state/trainer.json").exists()
    run = copy_run(ref, tmp_path / "run")
    for rel in ("iter-0001/update", "policy/iter-0002"):
        shutil.rmtree(run / rel)
    recorded_file = run / "iter-0000/update/MANIFEST.json"
    text = recorded_file.read_text()
    recorded = manifest(run, "iter-0000/update")["policy_hash"]
    recorded_file.write_text(text.replace(recorded, "0" * 64))

    out = grpo("update", str(run), "--iter", "1", check=False)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: update iteration 0: re-run from its stored parts"), out.stderr[-3000:]
    assert recorded[:16] in lines[0] and "0" * 16 in lines[0]
    assert not (run / "policy/iter-0002").exists() and not done(run, "iter-0001/update")

    recorded_file.write_text(text)
    grpo("update", str(run), "--iter", "1")
    assert record(run) == record(ref), first_difference(run, ref)
    assert (run / "iter-0001/update/state/trainer.json").exists()  # the end of a command writes it
    assert not (run / "iter-0000/update/state").exists()

    # the state `iterate` writes at its end comes after its last update's manifest (update 0 here): it
    # names its own hash. A resume from it edited stops with one line naming it, nothing written; as
    # written, it resumes to the uninterrupted run's bytes
    for rel in ("iter-0000/update", "policy/iter-0001", "iter-0001/update", "policy/iter-0002"):
        shutil.rmtree(run / rel)
    grpo("iterate", str(run), "--iters", "1")
    assert "state" not in manifest(run, "iter-0000/update")["outputs"]
    assert manifest(run, "iter-0000/update/state")["stage"] == "state"
    state_file = run / "iter-0000/update/state/trainer.json"
    text = state_file.read_text()
    state_file.write_text(text + " ")  # still a valid trainer.json: only the record can tell
    out = grpo("update", str(run), "--iter", "1", check=False)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith(f"error: {run}/iter-0000/update/state: the trainer state of iteration 0 hashes to "), lines[0]
    assert "iter-0000/update/state/MANIFEST.json records" in lines[0]
    assert not (run / "policy/iter-0002").exists() and not done(run, "iter-0001/update")
    state_file.write_text(text)
    grpo("update", str(run), "--iter", "1")
    assert record(run) == record(ref), first_difference(run, ref)


def test_a_resume_that_must_rerun_updates_in_another_process_count_stops_with_one_line(assets, tmp_path_factory, tmp_path):
    """The reference run's updates were recorded by one process and kept no state after update 0.
    Update 1 under torchrun over 2 processes would re-run update 0 over 2, whose gradients sum in
    another order: its policy hash could not be the recorded one. Every rank stops before any
    work with one line naming the iteration and the process count to resume with, not a hash
    mismatch that blames the record."""
    ref = reference_run(tmp_path_factory, assets)
    run = copy_run(ref, tmp_path / "run")
    for rel in ("iter-0001/update", "policy/iter-0002"):
        shutil.rmtree(run / rel)
    assert not (run / "iter-0000/update/state").exists()
    torchrun = str(Path(sys.executable).parent / "torchrun")
    out = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", "-m", "stages.cli", "update", str(run), "--iter", "1"],
                         cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert out.returncode != 0
    text = out.stdout + out.stderr  # the ranks' lines may interleave: the message is looked for, not a line
    assert ("error: update iteration 0: its trainer state was not kept (train.state_every 10) and resuming re-runs it, "
            "but it was recorded by 1 process(es) in fp32 and this update has 2 in fp32; "
            "resume with 1 process(es) on a machine computing in fp32") in text, text[-3000:]
    assert "re-run from its stored parts" not in text and "[rank1]: Traceback" not in text and "[rank0]: Traceback" not in text
    assert not (run / "policy/iter-0002").exists() and not done(run, "iter-0001/update")


def test_a_lora_dropout_update_resumed_or_rerun_in_a_new_process_is_the_warm_one(assets, tmp_path):
    """LoRA dropout draws from torch's RNG. In `iterate` the trainer is warm and rollouts and
    logprob passes run between its updates; `grpo update --iter 1` starts a new process from
    state 0, and without state 0 re-runs update 0 first. Each must publish the warm run's
    policy 2 (pipeline.update.rng seeds each update's draws from the seed and the iteration)."""
    cfg = base_config(assets, train={"mini_batch_size": 8, "lr": 1e-3, "precision": "fp32", "state_every": 1, "keep_states": 2,
                                     "lora": {"r": 4, "alpha": 8, "dropout": 0.5}})
    ref = tmp_path / "ref"
    grpo("init", str(ref), "--config", str(write_config(tmp_path / "config.yaml", cfg)))
    grpo("iterate", str(ref), "--iters", "2")
    assert (ref / "iter-0000/update/state/trainer.json").exists()
    for name, without in (("from-state", ()), ("re-run", ("iter-0000/update/state",))):
        run = copy_run(ref, tmp_path / name)
        for rel in ("iter-0001/update", "policy/iter-0002", *without):
            shutil.rmtree(run / rel)
        grpo("update", str(run), "--iter", "1")
        assert manifest(run, "policy/iter-0002")["policy_hash"] == manifest(ref, "policy/iter-0002")["policy_hash"], name
        assert record(run) == record(ref), first_difference(run, ref)
