"""Audit: a clean run passes with one summary line; every changed byte, missing or swapped
file and broken lineage link fails and is named on its own line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import grpo
from test_reproduce import copy_run, reference_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ref(assets, tmp_path_factory) -> Path:
    return reference_run(tmp_path_factory, assets)


def audit(run: Path):
    from pipeline.report.audit import audit_run
    from pipeline.run.run import Run

    report = audit_run(Run(str(run)))
    assert all("\n" not in line for line in report.problems)
    return report


def edit_json(path: Path, change) -> None:
    body = json.loads(path.read_text())
    change(body)
    path.write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")


def flip_byte(path: Path, offset: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def swap(a: Path, b: Path) -> None:
    tmp = a.with_name("swap-tmp")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


def test_clean_run_exits_0_with_one_line(ref):
    out = grpo("audit", str(ref))
    assert out.returncode == 0
    assert out.stdout.strip().splitlines() == [
        f"audit {ref}: ok, 2 iteration(s), 11 manifests and {audit(ref).files} files verified, lineage intact"
    ]


# each tampering and the line audit must print for it (among the lines of what follows from it)
TAMPERINGS = {
    "changed byte in a rollout part": (
        lambda r: flip_byte(r / "iter-0000/rollout/part-00001.parquet"),
        "iter-0000/rollout/part-00001.parquet: sha256 ",
    ),
    "changed byte in the policy weights": (
        lambda r: flip_byte(r / "policy/iter-0001/model.safetensors", offset=-5),
        "policy/iter-0001/model.safetensors: sha256 ",
    ),
    "changed byte in update metrics": (
        lambda r: flip_byte(r / "iter-0000/update/metrics.parquet"),
        "iter-0000/update/metrics.parquet: sha256 ",
    ),
    "missing score part": (
        lambda r: (r / "iter-0001/score/part-00000.parquet").unlink(),
        "iter-0001/score/part-00000.parquet: missing (listed in MANIFEST.json)",
    ),
    "missing policy file": (
        lambda r: (r / "policy/iter-0002/tokenizer.json").unlink(),
        "policy/iter-0002/tokenizer.json: missing (listed in MANIFEST.json)",
    ),
    "swapped logprobs parts": (
        lambda r: swap(r / "iter-0000/logprobs/part-00000.parquet", r / "iter-0000/logprobs/part-00001.parquet"),
        "iter-0000/logprobs/part-00000.parquet: sha256 ",
    ),
    "score part of another iteration": (
        lambda r: shutil.copy(r / "iter-0001/score/part-00000.parquet", r / "iter-0000/score/part-00000.parquet"),
        "iter-0000/score/part-00000.parquet: sha256 ",
    ),
    "swapped policy directories": (
        lambda r: swap(r / "policy/iter-0001", r / "policy/iter-0002"),
        "policy/iter-0001/MANIFEST.json: describes policy iteration 2, expected policy 1",
    ),
    "unlisted extra part": (
        lambda r: shutil.copy(r / "iter-0001/rollout/part-00001.parquet", r / "iter-0001/rollout/part-00002.parquet"),
        "iter-0001/rollout/part-00002.parquet: part not listed in MANIFEST.json",
    ),
    "row count edited in a manifest": (
        lambda r: edit_json(r / "iter-0000/score/MANIFEST.json", lambda m: m["outputs"]["part-00000.parquet"].update(rows=7)),
        "iter-0000/score/part-00000.parquet: 8 rows, MANIFEST.json says 7",
    ),
    "schema version edited in a manifest": (
        lambda r: edit_json(r / "iter-0001/logprobs/MANIFEST.json", lambda m: m.update(schema_version=2)),
        "iter-0001/logprobs/MANIFEST.json: schema_version 2, this grpo reads version 1",
    ),
    "rollout manifest rewritten (score's link breaks)": (
        lambda r: edit_json(r / "iter-0001/rollout/MANIFEST.json", lambda m: m["timings"].update(seconds=0.5)),
        "iter-0001/score/MANIFEST.json: inputs.rollout.manifest_sha256 does not match iter-0001/rollout/MANIFEST.json",
    ),
    "rollout manifest deleted (score links to nothing)": (
        lambda r: (r / "iter-0000/rollout/MANIFEST.json").unlink(),
        "iter-0000/score/MANIFEST.json: links to iter-0000/rollout, which has no manifest",
    ),
    "update manifest links another policy": (
        lambda r: edit_json(r / "iter-0000/update/MANIFEST.json", lambda m: m["inputs"].update(policy_hash="0" * 64)),
        "iter-0000/update/MANIFEST.json: inputs.policy_hash does not match policy/iter-0000",
    ),
    "policy lineage names other score parts": (
        lambda r: edit_json(r / "policy/iter-0002/MANIFEST.json", lambda m: m["lineage"]["inputs"].update(score="0" * 64)),
        "policy/iter-0002/MANIFEST.json: lineage.inputs.score does not match iter-0001/score/MANIFEST.json",
    ),
    "config edited after the run": (
        lambda r: (r / "config.yaml").write_text((r / "config.yaml").read_text().replace("\nseed: 0\n", "\nseed: 3\n")),
        "config.yaml: its hash ",
    ),
}


@pytest.mark.parametrize("name", sorted(TAMPERINGS))
def test_tampering_is_named(ref, tmp_path, name):
    tamper, line = TAMPERINGS[name]
    run = copy_run(ref, tmp_path / "run")
    tamper(run)
    report = audit(run)
    assert not report.ok
    assert any(p.startswith(line) for p in report.problems), report.problems


def test_problems_print_one_line_each_and_exit_1(ref, tmp_path):
    run = copy_run(ref, tmp_path / "run")
    flip_byte(run / "iter-0001/logprobs/part-00001.parquet")
    (run / "policy/iter-0001/config.json").unlink()
    out = grpo("audit", str(run), check=False)
    assert out.returncode == 1
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("policy/iter-0001/config.json: missing")
    assert lines[1].startswith("iter-0001/logprobs/part-00001.parquet: sha256 ")
    assert lines[-1] == f"audit {run}: 2 problem(s)"


def test_interrupted_attempts_are_ignored_not_counted(ref, tmp_path):
    """Parts without a manifest (a stage that died) and a policy whose update has no manifest
    are not part of the record: audit passes and says it skipped them."""
    run = copy_run(ref, tmp_path / "run")
    (run / "iter-0002/rollout").mkdir(parents=True)
    shutil.copy(run / "iter-0001/rollout/part-00000.parquet", run / "iter-0002/rollout/part-00000.parquet")
    report = audit(run)
    assert report.ok, report.problems
    assert report.skipped == ["iter-0002/rollout"]
    assert "1 interrupted attempt(s) without a manifest ignored" in report.summary()

    (run / "iter-0001/update/MANIFEST.json").unlink()  # as if killed between policy 2 and this manifest
    report = audit(run)
    assert report.ok, report.problems
    assert report.skipped == ["iter-0001/update", "policy/iter-0002", "iter-0002/rollout"]


def test_a_committed_link_to_an_uncommitted_policy_is_broken(ref, tmp_path):
    run = copy_run(ref, tmp_path / "run")
    (run / "iter-0000/update/MANIFEST.json").unlink()  # policy 1 is no longer committed...
    report = audit(run)
    assert not report.ok  # ...but iteration 1's rollout, logprobs and policy 2 were built on it
    assert report.problems[0] == "iter-0001/rollout/MANIFEST.json: links to policy/iter-0001, which has no committed manifest"


def test_not_a_run_is_a_one_line_error(tmp_path):
    out = grpo("audit", str(tmp_path / "nothing"), check=False)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [f"error: {tmp_path / 'nothing'}: not a grpo run (no config.yaml); create it with `grpo init`"]


def test_a_record_without_weights_audits_with_without_weights_and_still_names_a_changed_part(ref, tmp_path):
    """The GPU proof brings back its runs without the policies' weights (bench/gpu/proof.py):
    `--without-weights` lets those be absent and still checks every other file and hash."""
    run = copy_run(ref, tmp_path / "run")
    for policy in (run / "policy").glob("iter-*"):  # not the write locks beside them (policy/.lock-iter-K)
        for f in policy.iterdir():
            if f.name != "MANIFEST.json":
                f.unlink()
    assert grpo("audit", str(run), check=False).returncode == 1  # plainly, the weights are missing
    out = grpo("audit", str(run), "--without-weights")
    assert "policies' weight files absent and not checked (--without-weights)" in out.stdout
    flip_byte(run / "iter-0001/logprobs/part-00001.parquet")
    out = grpo("audit", str(run), "--without-weights", check=False)
    assert out.returncode == 1
    assert out.stdout.splitlines()[0].startswith("iter-0001/logprobs/part-00001.parquet: sha256 ")
