"""The trainer's process group: made without a launcher from variables that do not outlive its
start, so a process started afterwards (a `grpo` command) sees no launcher; one rank-0 rule."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO, grpo
from pipeline.update.distributed import LAUNCHER_VARS, close_distributed, init_distributed, is_rank_zero, local_rank_env

PROBE = "from pipeline.update.distributed import init_distributed; print(init_distributed())"


def _launcher() -> dict:
    return {k: os.environ.get(k) for k in LAUNCHER_VARS}


def test_a_one_process_group_leaves_no_launcher_variables_behind():
    import deepspeed  # noqa: F401  its import sets PYTORCH_NVML_BASED_CUDA_CHECK (and polars' its allocator's
    import torch      # settings): any process importing them sets the same, so they are no leak

    close_distributed()  # a group an earlier test's trainer left: this test makes its own
    before = dict(os.environ)
    assert all(v is None for v in _launcher().values())
    assert init_distributed() == (0, 1)
    assert torch.distributed.is_initialized() and torch.distributed.get_backend() == "gloo"
    assert dict(os.environ) == before  # RANK, MASTER_PORT, ... were there only while the group formed
    assert is_rank_zero()
    with local_rank_env():  # what DeepSpeed's engine reads while it starts and trains
        assert os.environ["LOCAL_RANK"] == "0"
    assert "LOCAL_RANK" not in os.environ
    # a process started now sees no launcher: it makes its own group on its own port (before,
    # it inherited RANK and this group's MASTER_PORT, and failed to bind it: EADDRINUSE)
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-1] == "(0, 1)"
    assert init_distributed() == (0, 1)  # joining again is a no-op
    close_distributed()
    assert not torch.distributed.is_initialized() and dict(os.environ) == before


def test_rank_zero_is_the_launchers_rank_before_a_group_exists(monkeypatch):
    import torch

    if torch.distributed.is_initialized():
        close_distributed()
    assert is_rank_zero()
    monkeypatch.setenv("RANK", "1")
    assert not is_rank_zero()
    monkeypatch.setenv("RANK", "0")
    assert is_rank_zero()


@pytest.mark.slow
def test_a_grpo_command_runs_after_an_update_in_this_process(make_run):
    """Issue 29: a library user updates in process (the trainer kept warm, its group alive) and
    then starts `grpo` commands: they run, and this process's environment is as it was."""
    from pipeline.logprobs import run_logprobs
    from pipeline.rollout import run_rollout
    from pipeline.score import run_score
    from pipeline.run.run import Run
    from pipeline.update.publish import run_update

    def update(name: str):
        run = Run(make_run(name, rollout={"engine": "hf"}))
        run_rollout(run, 0)
        run_score(run, 0)
        run_logprobs(run, 0)
        return run_update(run, 0)

    before = dict(os.environ)
    manifest, trainer = update("in-process")
    try:
        assert manifest is not None and dict(os.environ) == before
        other = make_run("subprocess", rollout={"engine": "hf"})
        grpo("iterate", other, "--iters", "1")  # its own trainer, its own group: no EADDRINUSE
        assert grpo("status", other).returncode == 0
    finally:
        trainer.close()
    assert dict(os.environ) == before
    # and a second trainer in this process, after the first closed its group (a second `iterate`)
    manifest, trainer = update("again")
    trainer.close()
    assert manifest is not None and dict(os.environ) == before
