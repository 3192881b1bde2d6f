"""Reproducible: the same config, seed and inputs give byte-identical rollout, score and
logprobs parts and the same policies in separate processes, and `grpo audit --compare` names
the first artifact where two runs part.

`reference_run` (one uninterrupted `grpo iterate --iters 2` in its own process, built once
per session) is also what test_resume, test_audit, test_replay and test_bad_input start from.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import base_config, grpo, write_config

pytestmark = pytest.mark.slow


def reference_run(tmp_path_factory, assets) -> Path:
    """An uninterrupted 2-iteration run of `base_config`, built once per session (read-only:
    tests that change a run copy it first)."""
    root = tmp_path_factory.getbasetemp() / "reference"
    run = root / "run"
    if not (root / "complete").exists():
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir()
        cfg = write_config(root / "config.yaml", base_config(assets))
        grpo("init", str(run), "--config", str(cfg))
        grpo("iterate", str(run), "--iters", "2")
        (root / "complete").touch()
    return run


def copy_run(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def manifest(run: Path, rel: str) -> dict:
    return json.loads((run / rel / "MANIFEST.json").read_text())


def record(run: Path, iters: int = 2) -> dict:
    """What must match between equivalent runs: every part's sha256, each update's metrics
    sha256 and every policy hash (all as the manifests record them)."""
    out = {}
    for k in range(iters):
        for stage in ("rollout", "score", "logprobs"):
            out[f"iter-{k:04d}/{stage}"] = {n: o["sha256"] for n, o in manifest(run, f"iter-{k:04d}/{stage}")["outputs"].items()}
        out[f"iter-{k:04d}/update"] = manifest(run, f"iter-{k:04d}/update")["outputs"]["metrics.parquet"]["sha256"]
    for k in range(iters + 1):
        out[f"policy/iter-{k:04d}"] = manifest(run, f"policy/iter-{k:04d}")["policy_hash"]
    return out


def first_difference(a: Path, b: Path, iters: int = 2) -> str:
    """Where two runs' updates part: the first metric that differs, with both values in full
    (the assertion on `record` alone shows only hashes)."""
    for k in range(iters):
        rel = f"iter-{k:04d}/update/metrics.parquet"
        if not (a / rel).exists() or not (b / rel).exists():
            continue
        ma, mb = pq.read_table(a / rel).to_pylist(), pq.read_table(b / rel).to_pylist()
        for step, (ra, rb) in enumerate(zip(ma, mb)):
            for key in ra:
                if repr(ra[key]) != repr(rb.get(key)):
                    return f"update {k} row {step} {key}: {ra[key]!r} vs {rb.get(key)!r}"
        if len(ma) != len(mb):
            return f"update {k}: {len(ma)} vs {len(mb)} rows"
    return "no update metric differs"


@pytest.fixture(scope="module")
def twins(assets, tmp_path_factory):
    """The reference run and one iteration of the same config, run again in another process.
    (Iteration 1, whose update carries the trainer state over, is rebuilt across processes by
    test_resume, which compares it with the reference too.)"""
    ref = reference_run(tmp_path_factory, assets)
    root = tmp_path_factory.mktemp("twin")
    twin = root / "twin"
    cfg = write_config(root / "config.yaml", base_config(assets))
    grpo("init", str(twin), "--config", str(cfg))
    grpo("iterate", str(twin), "--iters", "1")
    return ref, twin


def test_same_config_gives_byte_identical_parts_and_policies(twins):
    ref, twin = twins
    a, b = record(ref, iters=1), record(twin, iters=1)
    assert len(a) == 4 + 2
    assert a == b, first_difference(ref, twin, iters=1)  # parts, metrics and policies: the update is exact on one machine
    for stage in ("rollout", "score", "logprobs"):  # and the files themselves, not only what the manifests say
        for part in sorted((ref / "iter-0000" / stage).glob("part-*.parquet")):
            assert part.read_bytes() == (twin / part.relative_to(ref)).read_bytes(), part
    assert a["policy/iter-0001"] != a["policy/iter-0000"]  # training did move the weights


def test_compare_says_identical_runs_agree(twins, tmp_path):
    ref, twin = twins
    first = copy_run(ref, tmp_path / "first")  # the reference as it stood after iteration 0
    shutil.rmtree(first / "iter-0001")
    shutil.rmtree(first / "policy/iter-0002")
    out = grpo("audit", "--compare", str(first), str(twin))
    assert out.returncode == 0
    assert out.stdout.strip().splitlines() == [f"{first} and {twin} agree: 9 artifacts identical"]  # 2 policies + 6 parts + metrics


def _rewrite_reward(part: Path, row: int, value: float) -> None:
    """Rewrite a score part with one reward changed, keeping its stamp: as if that reward
    function had said something else for one completion."""
    table = pq.read_table(part)
    rewards = table.column("reward").to_pylist()
    rewards[row] = value
    table = table.set_column(table.schema.get_field_index("reward"), table.schema.field("reward"), pa.array(rewards, pa.float64()))
    pq.write_table(table, part, compression="zstd", write_statistics=False, store_schema=True)


def test_compare_names_the_first_diverging_artifact(twins, tmp_path):
    from pipeline.report.compare import compare_runs
    from pipeline.run.run import Run
    from pipeline.store import sha256_bytes

    ref, _ = twins
    other = copy_run(ref, tmp_path / "other")
    part = other / "iter-0001/score/part-00001.parquet"
    _rewrite_reward(part, row=3, value=7.0)
    m = manifest(other, "iter-0001/score")
    m["outputs"]["part-00001.parquet"].update(sha256=sha256_bytes(part.read_bytes()), bytes=part.stat().st_size)
    (other / "iter-0001/score/MANIFEST.json").write_text(json.dumps(m))
    # a later artifact differs too (the policy trained on it would); the first one is named
    (other / "iter-0001/update/metrics.parquet").write_bytes(b"not the same")

    result = compare_runs(Run(str(ref)), Run(str(other)))
    assert result.config is None
    assert result.first.startswith("iter-0001/score/part-00001.parquet: differs (sha256 ")
    assert result.compared == 1 + 6 + 1 + 1 + 2 + 1  # policy 0, iteration 0's 6 parts + metrics, policy 1, rollout 1, score 1 part 0

    out = grpo("audit", "--compare", str(ref), str(other), check=False)
    assert out.returncode == 1
    assert out.stdout.strip().splitlines() == [result.first]


def test_compare_reports_config_and_missing_iterations(twins, tmp_path):
    from pipeline.report.compare import compare_runs
    from pipeline.run.run import Run

    ref, _ = twins
    short = copy_run(ref, tmp_path / "short")
    shutil.rmtree(short / "iter-0001")
    shutil.rmtree(short / "policy/iter-0002")
    result = compare_runs(Run(str(ref)), Run(str(short)))
    assert result.config is None
    assert result.first == f"iter-0001/rollout/part-00000.parquet: only in {ref}"

    reseeded = copy_run(ref, tmp_path / "reseeded")
    text = (reseeded / "config.yaml").read_text()
    assert "\nseed: 0\n" in text
    (reseeded / "config.yaml").write_text(text.replace("\nseed: 0\n", "\nseed: 1\n"))
    result = compare_runs(Run(str(ref)), Run(str(reseeded)))
    assert result.config == "config.yaml: differs at seed (0 vs 1)"
    assert result.first is None  # the artifacts themselves were copied
    assert not result.same
