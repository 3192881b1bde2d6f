"""Bounded staleness (`train.max_staleness: 1`): iteration k samples from policy max(0, k - 1)
while `iterate` trains iteration k-1 in the other process; the schedule is fixed by the config,
so the separate stage commands, a resume after SIGKILL at several moments and a replay give the
bytes one uninterrupted `iterate` gives, and audit checks each rollout against its behaviour policy.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest

from conftest import base_config, grpo, short_answers_run, write_config
from test_reproduce import first_difference, record
from test_resume import killed, killed_when

ITERS = 3


def stale_config(assets, **sections) -> dict:
    train = {"mini_batch_size": 8, "lr": 1e-4, "precision": "fp32", "max_staleness": 1, **sections.pop("train", {})}
    return base_config(assets, train=train, **sections)


def manifest(run: Path, rel: str) -> dict:
    return json.loads((run / rel / "MANIFEST.json").read_text())


@pytest.fixture(scope="module")
def stale_run(assets, tmp_path_factory) -> Path:
    """One uninterrupted `grpo iterate --iters 3` with max_staleness 1 (read-only)."""
    root = tmp_path_factory.mktemp("stale")
    run = root / "run"
    grpo("init", str(run), "--config", str(write_config(root / "config.yaml", stale_config(assets))))
    grpo("iterate", str(run), "--iters", str(ITERS))
    return run


@pytest.mark.slow
def test_each_rollout_names_its_behaviour_policy_and_audit_checks_it(stale_run):
    from pipeline.report.audit import audit_run
    from pipeline.report.status import status_report
    from pipeline.run.run import Run

    hashes = [manifest(stale_run, f"policy/iter-{k:04d}")["policy_hash"] for k in range(ITERS + 1)]
    assert len(set(hashes)) == ITERS + 1  # every update moved the weights
    for k, (b, stale) in enumerate([(0, 0), (0, 1), (1, 1)]):  # b(k) = max(0, k - 1)
        m = manifest(stale_run, f"iter-{k:04d}/rollout")
        assert m["inputs"]["policy"] == {"path": f"policy/iter-{b:04d}", "policy_hash": hashes[b]}
        assert (m["policy_hash"], m["staleness"]) == (hashes[b], stale)
        column = pl.read_parquet(stale_run / f"iter-{k:04d}/rollout/*.parquet")["policy_hash"].unique().to_list()
        assert column == [hashes[b]]
        # the logprobs and the update start from policy k, not from the policy that sampled
        assert manifest(stale_run, f"iter-{k:04d}/logprobs")["inputs"]["policy_hash"] == hashes[k]
        assert manifest(stale_run, f"iter-{k:04d}/update")["inputs"]["policy_hash"] == hashes[k]
    report = audit_run(Run(str(stale_run)))
    assert report.ok, report.problems
    assert report.iterations == ITERS

    rows = status_report(Run(str(stale_run)))["iterations"]
    assert [r.get("rollout/staleness") for r in rows[:ITERS]] == [0.0, 1.0, 1.0]
    table = grpo("status", str(stale_run)).stdout
    assert "(policy 0, stale 1)" in table and "(policy 1, stale 1)" in table


@pytest.mark.slow
def test_audit_names_a_rollout_linked_to_the_wrong_policy(stale_run, tmp_path):
    """Iteration 2's rollout relabelled as sampled from policy 2 (the on-policy schedule's
    choice): audit says which policy it must name, and that its staleness is wrong."""
    from pipeline.report.audit import audit_run
    from pipeline.run.run import Run

    run = tmp_path / "run"
    shutil.copytree(stale_run, run)
    path = run / "iter-0002/rollout/MANIFEST.json"
    m = json.loads(path.read_text())
    p2 = manifest(run, "policy/iter-0002")["policy_hash"]
    m["inputs"]["policy"] = {"path": "policy/iter-0002", "policy_hash": p2}
    m["policy_hash"], m["staleness"] = p2, 0
    path.write_text(json.dumps(m))
    problems = audit_run(Run(str(run))).problems
    mrel = "iter-0002/rollout/MANIFEST.json"
    p1 = manifest(run, "policy/iter-0001")["policy_hash"]
    assert f"{mrel}: inputs.policy.policy_hash {p2[:12]} does not match policy/iter-0001 ({p1[:12]})" in problems
    assert f"{mrel}: staleness 0, expected 1 (train.max_staleness 1: sampled from policy/iter-0001)" in problems


@pytest.mark.slow
def test_separate_stage_commands_write_what_iterate_writes(stale_run, assets, tmp_path):
    """The four commands, one iteration after another in fresh processes: each rollout samples
    from policy k - 1 with no sampler process around, and every byte is iterate's. Two iterations:
    rollout 1 is the first whose k - 1 (policy 0) and k (policy 1) differ; a third adds no case."""
    run, iters = tmp_path / "run", 2
    grpo("init", str(run), "--config", str(write_config(tmp_path / "config.yaml", stale_config(assets))))
    for k in range(iters):
        for stage in ("rollout", "score", "logprobs", "update"):
            grpo(stage, str(run), "--iter", str(k))
    assert record(run, iters) == record(stale_run, iters), first_difference(run, stale_run, iters)
    for k in range(iters):
        for part in sorted((stale_run / f"iter-{k:04d}/rollout").glob("part-*.parquet")):
            assert part.read_bytes() == (run / part.relative_to(stale_run)).read_bytes(), part


@pytest.mark.slow
def test_killed_at_several_moments_then_rerun_finishes_the_run(stale_run, assets, tmp_path):
    """SIGKILLs of the sampler and of iterate itself at several moments; the rerun finishes the run
    to the uninterrupted run's bytes (every rollout, score, logprob and update artifact and every
    policy), with every stage done once and audit clean. The trainer trains beside the sampler on
    the same cores here, so this also checks that its arithmetic does not follow the thread
    schedule (`pipeline.update.determinism.serial_accumulation`)."""
    from pipeline.report.audit import audit_run
    from pipeline.run.run import Run

    run = tmp_path / "run"
    R = str(run)
    grpo("init", R, "--config", str(write_config(tmp_path / "config.yaml", stale_config(assets))))

    # the sampler dies after iteration 1's first part, a rollout it sampled while update 0 ran
    out = grpo("iterate", R, "--iters", str(ITERS), env={"GRPO_FAULT": "rollout:part:1"}, check=False)
    assert out.returncode == 1, out.stderr[-3000:]
    assert ("iterate: the sampler process died (killed by SIGKILL) before rollout of iteration 1 was done; "
            "rerun the same command to resume") in out.stderr, out.stderr[-3000:]
    assert (run / "iter-0001/rollout/part-00000.parquet").exists() and not (run / "iter-0001/rollout/MANIFEST.json").exists()

    # this process is SIGKILLed while the sampler writes iteration 2's rollout (from policy 1,
    # beside iteration 1's training): the sampler goes with it, nothing finishes that rollout
    killed_when(run / "iter-0002/rollout/part-00000.parquet", "iterate", R, "--iters", str(ITERS), log=tmp_path / "killed.log")
    time.sleep(3)
    assert not (run / "iter-0002/rollout/part-00001.parquet").exists() and not (run / "iter-0002/rollout/MANIFEST.json").exists()
    assert (run / "iter-0001/rollout/MANIFEST.json").exists() and not (run / "iter-0001/update/MANIFEST.json").exists()

    # killed in update 1 (trained, nothing saved), then between publishing policy 2 and the update's manifest
    killed("iterate", R, "--iters", str(ITERS), fault="update:train:1")
    assert not (run / "policy/iter-0002/MANIFEST.json").exists()
    killed("iterate", R, "--iters", str(ITERS), fault="update:publish:1")
    assert (run / "policy/iter-0002/MANIFEST.json").exists() and not (run / "iter-0001/update/MANIFEST.json").exists()
    grpo("iterate", R, "--iters", str(ITERS))

    assert record(run, ITERS) == record(stale_run, ITERS), first_difference(run, stale_run, ITERS)
    for k in range(ITERS):
        for part in sorted((stale_run / f"iter-{k:04d}/rollout").glob("part-*.parquet")):
            assert part.read_bytes() == (run / part.relative_to(stale_run)).read_bytes(), part
        assert manifest(run, f"iter-{k:04d}/rollout")["inputs"]["policy"]["path"] == f"policy/iter-{max(0, k - 1):04d}"
    report = audit_run(Run(R))
    assert report.ok, report.problems
    assert report.skipped == []
    assert [p for p in run.rglob("*") if p.name.startswith(".tmp-") or p.name == ".work"] == []


@pytest.mark.slow
def test_replay_of_a_stale_iteration(stale_run, tmp_path):
    """Iteration 2 was sampled from policy 1: the replay starts from policy 2 (what update 2
    trained), keeps the copied rollout's staleness, and its logprobs are policy 2's."""
    from pipeline.report.audit import audit_run
    from pipeline.run.run import Run

    new = tmp_path / "new"
    grpo("replay", str(stale_run), "--iter", "2", "--to", str(new), "--until", "logprobs")
    m = manifest(new, "iter-0000/rollout")
    assert m["outputs"] == manifest(stale_run, "iter-0002/rollout")["outputs"]
    assert m["staleness"] == 1 and m["replayed_from"]["iteration"] == 2
    assert manifest(new, "policy/iter-0000")["policy_hash"] == manifest(stale_run, "policy/iter-0002")["policy_hash"]
    # the same old logprobs the source's logprobs stage computed from policy 2
    src = pq.read_table(stale_run / "iter-0002/logprobs/part-00000.parquet").column("old_logprobs")
    assert pq.read_table(new / "iter-0000/logprobs/part-00000.parquet").column("old_logprobs").equals(src)
    report = audit_run(Run(str(new)))
    assert report.ok, report.problems


@pytest.mark.slow
def test_a_rewarded_behaviour_grows_with_stale_samples(assets, tmp_path):
    """test_e2e's learning check with max_staleness 1: iteration 3 samples from policy 2, the
    policy on-policy iteration 2 samples from, and the rare short answers have become common."""
    run, means = short_answers_run(assets, tmp_path, 4, max_staleness=1)
    assert manifest(run, "iter-0003/rollout")["inputs"]["policy"]["path"] == "policy/iter-0002"
    assert means[0] < 0.5, means  # the behaviour starts out rare...
    assert means[3] > means[0] + 0.3, means  # ...and GRPO on one-update-old samples makes it common


def test_init_refuses_staleness_it_cannot_correct(assets, tmp_path):
    """reinforce has no importance ratio to weigh stale samples with: one line at init, no run."""
    cfg = write_config(tmp_path / "cfg.yaml", stale_config(assets, loss={"type": "reinforce"}))
    out = grpo("init", str(tmp_path / "run"), "--config", str(cfg), check=False)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"error: {cfg}: train.max_staleness 1: loss.type reinforce has no importance ratio to correct "
        "samples from an older policy with; use a clipped loss (grpo, bnpo, dr_grpo, dapo) or max_staleness 0"
    ]
    assert not (tmp_path / "run").exists()
    out = grpo("init", str(tmp_path / "run"), "--config", str(cfg), "--set", "train.max_staleness=-1", check=False)
    assert out.returncode == 1 and "train.max_staleness: Input should be greater than or equal to 0" in out.stderr
    assert not (tmp_path / "run").exists()


def test_staleness_zero_keeps_the_config_hash_and_the_schedule(assets):
    from pipeline import config as config_mod
    from pipeline.schedule import behaviour, staleness

    plain = config_mod.resolve(base_config(assets))
    zero = config_mod.resolve(base_config(assets, train={"max_staleness": 0}))
    two = config_mod.resolve(base_config(assets, train={"max_staleness": 2}))
    assert config_mod.config_hash(plain) == config_mod.config_hash(zero) != config_mod.config_hash(two)
    assert "max_staleness" not in config_mod.canonical(zero)
    assert [behaviour(zero, k) for k in range(4)] == [0, 1, 2, 3] and staleness(zero, 3) is None
    assert [behaviour(two, k) for k in range(5)] == [0, 0, 0, 1, 2]  # max(0, k - 2)
    assert [staleness(two, k) for k in range(5)] == [0, 1, 2, 2, 2]
