"""Policy retention (`train.keep_policies`): older policies lose their weights, never their
manifests; audit reports them as pruned and still follows the lineage; replay of a pruned
iteration is a one-line error; resume needs only the newest policy and trainer state."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import base_config, grpo, write_config
from test_reproduce import manifest, reference_run


@pytest.mark.parametrize(
    "newest, last, every, want",
    [
        (5, None, 0, {0, 1, 2, 3, 4, 5}),  # the default keeps everything
        (5, 1, 0, {0, 5}),
        (5, 2, 0, {0, 4, 5}),
        (9, 2, 4, {0, 4, 8, 9}),
        (4, 1, 2, {0, 2, 4}),
        (1, 1, 0, {0, 1}),
    ],
)
def test_kept_set(newest, last, every, want):
    from pipeline.run.retention import kept

    assert kept(newest, last, every) == want


def test_keep_policies_is_validated():
    from pipeline import config as config_mod
    from pipeline.errors import GRPOError

    tree = {"model": "m", "data": {"train": "t.jsonl"}, "rewards": [{"fn": "correct"}]}
    assert config_mod.resolve(tree).train.keep_policies.last is None
    cfg = config_mod.resolve(tree, ["train.keep_policies.last=2", "train.keep_policies.every=5"])
    assert (cfg.train.keep_policies.last, cfg.train.keep_policies.every) == (2, 5)
    with pytest.raises(GRPOError, match=r"^config: train.keep_policies.last: Input should be greater than or equal to 1$"):
        config_mod.resolve(tree, ["train.keep_policies.last=0"])
    with pytest.raises(GRPOError, match=r"^config: train.keep_policies.keep: unknown key$"):
        config_mod.resolve(tree, ["train.keep_policies.keep=1"])


def policy_files(run: Path, k: int) -> list[str]:
    return sorted(p.name for p in (run / f"policy/iter-{k:04d}").iterdir())


@pytest.mark.slow
def test_retained_run_resumes_audits_and_refuses_replay_of_pruned(assets, tmp_path_factory, tmp_path):
    from pipeline.report.audit import audit_run
    from pipeline.run.run import Run

    ref = reference_run(tmp_path_factory, assets)  # the same settings, every policy kept
    run = tmp_path / "run"
    R = str(run)
    cfg = base_config(assets, train={"mini_batch_size": 8, "lr": 1e-4, "keep_policies": {"last": 1, "every": 2}})
    grpo("init", R, "--config", str(write_config(tmp_path / "config.yaml", cfg)))

    # killed after publishing policy 2, before update 1's manifest: nothing pruned yet, so the
    # rerun redoes update 1 from policy 1
    out = grpo("iterate", R, "--iters", "3", env={"GRPO_FAULT": "update:publish:1"}, check=False)
    assert out.returncode < 0, out.stderr[-2000:]
    assert (run / "policy/iter-0001/model.safetensors").exists()
    grpo("iterate", R, "--iters", "3")
    # update 1 kept {0, 2 (the last and every 2nd)} and pruned policy 1; update 2 kept {0, 2, 3}
    assert policy_files(run, 1) == ["MANIFEST.json", "PRUNED.json"]
    assert "PRUNED.json" not in policy_files(run, 2)
    stone = json.loads((run / "policy/iter-0001/PRUNED.json").read_text())
    assert stone["pruned_by"] == "iter-0001/update" and stone["kept"] == [0, 2]
    assert "model.safetensors" in stone["files_removed"]
    assert "model.safetensors" in manifest(run, "policy/iter-0001")["files"]  # the hashes stay

    # resume in a fresh process: only the newest policy (3) and trainer state are needed
    grpo("iterate", R, "--iters", "4")
    for k, pruned in ((0, False), (1, True), (2, False), (3, True), (4, False)):
        assert ("PRUNED.json" in policy_files(run, k)) == pruned, k
        assert ("model.safetensors" in policy_files(run, k)) != pruned, k
    # retention changes which files stay, never what is trained
    for k in (1, 2):
        assert manifest(run, f"policy/iter-{k:04d}")["policy_hash"] == manifest(ref, f"policy/iter-{k:04d}")["policy_hash"]

    report = audit_run(Run(R))
    assert report.ok, report.problems
    assert report.pruned == ["policy/iter-0001", "policy/iter-0003"]
    assert report.iterations == 4
    out = grpo("audit", R)
    assert out.stdout.strip().splitlines() == [report.summary()]
    assert "lineage intact; pruned by train.keep_policies (manifest and hashes kept, weights removed): iter-0001, iter-0003" in out.stdout

    # replay of a pruned iteration: one line, non-zero exit, nothing written
    new = tmp_path / "replay-1"
    out = grpo("replay", R, "--iter", "1", "--to", str(new), check=False)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0] == (
        f"error: {R}/policy/iter-0001: pruned by train.keep_policies last 1, every 2 (only its manifest and hashes remain); "
        "replay of iteration 1 needs its weights; policies with weights: 0, 2, 4"
    )
    assert not new.exists()
    # a kept one replays
    grpo("replay", R, "--iter", "2", "--to", str(tmp_path / "replay-2"), "--until", "score")

    # the pruned policy's manifest still anchors the lineage: tampering with it is caught
    bad = tmp_path / "bad"
    shutil.copytree(run, bad)
    m = bad / "policy/iter-0003/MANIFEST.json"
    body = json.loads(m.read_text())
    body["files"]["model.safetensors"] = "0" * 64
    m.write_text(json.dumps(body))
    problems = audit_run(Run(str(bad))).problems
    assert "policy/iter-0003/MANIFEST.json: policy_hash is not the hash of its file list" in problems
