"""`--shard i/N`: N worker processes pointed at one run directory write what one worker writes.

Six prompts with one group per part make six parts; 2 workers write parts {0,2,4} and {1,3,5},
3 workers {0,3}, {1,4} and {2,5}. Every stage's manifest (written by whichever shard completes
the set) must list the same outputs, byte for byte (sha256), as the unsharded run's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, base_config

pytestmark = pytest.mark.slow

STAGES = ("rollout", "score", "logprobs")
PARTS = 6


def shard_config(assets: dict, engine: str) -> dict:
    return base_config(assets, rollout={"engine": engine, "prompts_per_iter": PARTS, "groups_per_part": 1, "max_new_tokens": 16})


def new_run(path: Path, cfg: dict) -> str:
    from pipeline import config as config_mod
    from pipeline.run.run import init_run

    init_run(str(path), config_mod.resolve(cfg))
    return str(path)


def spawn(*args: str) -> subprocess.Popen:
    """One `grpo` worker process; one thread each, so workers sharing the 2 cores agree bit for bit."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "stages.cli", *args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(procs: list[subprocess.Popen]) -> list[str]:
    """Wait for every worker; their stdouts, or the first failure's output."""
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, f"{' '.join(p.args[3:])} failed ({p.returncode}):\n{out[-2000:]}\n{err[-3000:]}"
        outs.append(out)
    return outs


def manifest(run: str, stage: str) -> dict | None:
    path = Path(run) / "iter-0000" / stage / "MANIFEST.json"
    return json.loads(path.read_text()) if path.exists() else None


def one_worker(path: str) -> None:
    """The three stages unsharded, each a `grpo` process on one thread as the workers run (a
    process of its own: state other tests leave in the test process must not decide the bytes)."""
    for stage in STAGES:
        finish([spawn(stage, path)])


def test_two_and_three_shards_write_what_one_worker_writes(assets, tmp_path):
    cfg = shard_config(assets, "hf")
    one, two, three = (new_run(tmp_path / name, cfg) for name in ("one", "two", "three"))
    for stage in STAGES:  # each stage: 2 + 3 worker processes at once, racing for the manifest
        procs = [spawn(stage, two, "--shard", f"{i}/2") for i in range(2)]
        procs += [spawn(stage, three, "--shard", f"{i}/3") for i in range(3)]
        outs = finish(procs)
        assert sum("done" in out for out in outs[:2]) >= 1 and sum("done" in out for out in outs[2:]) >= 1
    one_worker(one)

    for stage in STAGES:
        ref = manifest(one, stage)
        assert sorted(ref["outputs"]) == [f"part-{p:05d}.parquet" for p in range(PARTS)]
        assert ref["rows"] == PARTS * cfg["rollout"]["num_generations"]
        for run in (two, three):
            m = manifest(run, stage)
            assert m["outputs"] == ref["outputs"], (run, stage)  # same bytes, part by part
            assert m["input_hash"] == ref["input_hash"]
            on_disk = sorted(n for n in os.listdir(Path(run) / "iter-0000" / stage) if not n.startswith("."))
            assert on_disk == sorted([*ref["outputs"], "MANIFEST.json"])  # no leftovers


def test_vllm_shards_the_last_one_writes_the_manifest(assets, tmp_path):
    """With vLLM: shard 1/2 alone leaves no manifest; shard 0/2 then completes the set."""
    cfg = shard_config(assets, "vllm")
    one, two = new_run(tmp_path / "one", cfg), new_run(tmp_path / "two", cfg)
    ref_out, first = finish([spawn("rollout", one), spawn("rollout", two, "--shard", "1/2")])
    assert "manifest follows when every shard is in" in first
    assert manifest(two, "rollout") is None
    written = sorted(n for n in os.listdir(Path(two) / "iter-0000" / "rollout") if n.startswith("part-"))
    assert written == [f"part-{p:05d}.parquet" for p in (1, 3, 5)]

    (last,) = finish([spawn("rollout", two, "--shard", "0/2")])
    assert "rollout iteration 0: done" in last
    ref, m = manifest(one, "rollout"), manifest(two, "rollout")
    assert m["outputs"] == ref["outputs"]
    assert m["engine"] == ref["engine"] == "vllm"
    assert len(m["outputs"]) == PARTS and m["rows"] == ref["rows"]
