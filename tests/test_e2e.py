"""The whole GRPO loop on the tiny model: four separate commands vs `grpo iterate`, the update's
loss against `policy_loss` recomputed from the stored parts, multi-epoch clipping, learning."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch

from conftest import base_config, grpo, padded, short_answers_run, write_config

pytestmark = pytest.mark.slow


def manifest(run: Path, k: int, stage: str) -> dict:
    return json.loads((run / f"iter-{k:04d}" / stage / "MANIFEST.json").read_text())


def policy_hash(run: Path, k: int) -> str:
    return json.loads((run / "policy" / f"iter-{k:04d}" / "MANIFEST.json").read_text())["policy_hash"]


def separate_and_iterate(root: Path, config: dict, iters: int = 2) -> tuple[Path, Path, str]:
    """The same config run twice for ITERS iterations: stage by stage, and with `iterate` (its stdout)."""
    cfg = write_config(root / "cfg.yaml", config)
    sep, itr = root / "separate", root / "iterate"
    grpo("init", str(sep), "--config", str(cfg))
    for k in range(iters):
        for stage in ("rollout", "score", "logprobs", "update"):
            grpo(stage, str(sep), "--iter", str(k))
    grpo("init", str(itr), "--config", str(cfg))
    return sep, itr, grpo("iterate", str(itr), "--iters", str(iters)).stdout


@pytest.fixture(scope="module")
def two_runs(assets, tmp_path_factory):
    """Two epochs with KL: the old logprobs come from the logprobs stage."""
    return separate_and_iterate(tmp_path_factory.mktemp("e2e"), base_config(
        assets, train={"mini_batch_size": 8, "lr": 3e-4, "epochs": 2}, loss={"kl_coef": 0.05}))


def test_iterate_writes_what_the_separate_commands_write(two_runs):
    sep, itr, _ = two_runs
    for k in range(2):
        for stage in ("rollout", "score", "logprobs"):
            assert manifest(sep, k, stage)["outputs"] == manifest(itr, k, stage)["outputs"], (k, stage)
        assert manifest(sep, k, "update")["outputs"]["metrics.parquet"]["sha256"] == manifest(itr, k, "update")["outputs"]["metrics.parquet"]["sha256"]
    for k in range(3):
        assert policy_hash(sep, k) == policy_hash(itr, k)


def test_one_step_iterations_write_the_same_artifacts_from_iterate_and_the_separate_commands(assets, tmp_path):
    """One optimizer step per iteration (the update's forward gives the old logprobs): `iterate`,
    which keeps no logprob model then, and the four commands write the same bytes; both audit clean.
    One iteration: starting from a trained policy is what two_runs checks in its second."""
    sep, itr, _ = separate_and_iterate(tmp_path, base_config(assets, train={"mini_batch_size": 16, "lr": 3e-4}), iters=1)
    assert manifest(sep, 0, "logprobs")["passes"]["forward_passes"] == 0
    for stage in ("rollout", "score", "logprobs"):
        assert manifest(sep, 0, stage)["outputs"] == manifest(itr, 0, stage)["outputs"], stage
    a, b = manifest(sep, 0, "update")["outputs"], manifest(itr, 0, "update")["outputs"]
    assert a["old_logprobs.parquet"]["rows"] == 16 and a["old_logprobs.parquet"] == b["old_logprobs.parquet"]
    assert a["metrics.parquet"] == b["metrics.parquet"]
    assert pl.read_parquet(sep / "iter-0000/update/metrics.parquet")["ratio/mean"].to_list() == [1.0]
    for k in range(2):
        assert policy_hash(sep, k) == policy_hash(itr, k)
    assert policy_hash(sep, 1) != policy_hash(sep, 0)
    for run in (sep, itr):
        assert ": ok, 1 iteration(s)" in grpo("audit", str(run)).stdout


def test_policy_changes_and_lineage_links(two_runs):
    sep, _, stdout = two_runs
    assert (sep / "policy/iter-0002/model.safetensors").is_file()
    assert policy_hash(sep, 2) != policy_hash(sep, 0)
    assert manifest(sep, 1, "rollout")["inputs"]["policy"]["policy_hash"] == policy_hash(sep, 1)
    assert "iter" in stdout.splitlines()[0]  # the iterate table header


def test_first_minibatch_loss_equals_policy_loss_from_parts(two_runs):
    """Recompute the first optimizer step's loss of iteration 0 from the stored parts."""
    from pipeline import config as config_mod
    from pipeline.objective.loss import policy_loss
    from pipeline.run.policy import load_model
    from pipeline.models.tokens import Batch, token_logprobs

    sep, _, _ = two_runs
    cfg = config_mod.load(sep / "config.yaml")
    it = sep / "iter-0000"
    df = (
        pl.read_parquet(it / "rollout/*.parquet")
        .join(pl.read_parquet(it / "score/*.parquet"), on=["prompt_id", "sample_idx"])
        .join(pl.read_parquet(it / "logprobs/*.parquet"), on=["prompt_id", "sample_idx"])
        .filter(pl.col("train"))
    )
    order = np.random.default_rng([cfg.seed, 0, 0]).permutation(df.height)[: cfg.train.mini_batch_size]
    rows = df[order.tolist()]
    batch = Batch.build(rows["prompt_ids"].to_list(), rows["completion_ids"].to_list())
    T = batch.completion_mask.shape[1]

    def pad(col):
        return padded(rows[col].to_list(), T)

    model = load_model(sep / "policy/iter-0000")
    with torch.no_grad():
        logp, entropy = token_logprobs(model, batch, cfg.rollout.temperature, with_entropy=True)
    loss, metrics = policy_loss(
        logp, pad("old_logprobs"), torch.tensor(rows["advantage"].to_numpy()), batch.completion_mask, cfg.loss,
        ref_logprobs=pad("ref_logprobs"), max_completion_length=cfg.rollout.max_new_tokens,
        num_items=int(batch.completion_mask.sum()), entropy=entropy,
    )
    logged = pl.read_parquet(it / "update/metrics.parquet").row(0, named=True)
    assert logged["step"] == 1 and logged["epoch"] == 0 and logged["batch"] == 0
    assert metrics["loss/policy"] == pytest.approx(logged["loss/policy"], abs=1e-5)
    assert metrics["kl/mean"] == pytest.approx(logged["kl/mean"], abs=1e-6)
    # first epoch, first step: the policy is the old policy, so every ratio is 1
    assert logged["ratio/mean"] == pytest.approx(1.0, abs=1e-5)


def test_second_epoch_ratios_move_and_clip(two_runs):
    sep, _, _ = two_runs
    m = pl.read_parquet(sep / "iter-0000/update/metrics.parquet")
    second = m.filter(pl.col("epoch") == 1)
    assert second.height > 0
    assert (second["ratio/mean"] - 1.0).abs().max() > 1e-4
    assert second["clip/ratio_region"].max() > 0.0
    assert m["grad_norm"].is_nan().sum() == 0 and (m["grad_norm"] > 0).all()


def test_a_rewarded_behaviour_grows(assets, tmp_path):
    """Reward short completions only; a few iterations raise the mean reward."""
    _, means = short_answers_run(assets, tmp_path, 3)
    assert means[0] < 0.5, means  # the behaviour starts out rare...
    assert means[2] > means[0] + 0.3, means  # ...and GRPO makes it common


def test_a_diverging_update_publishes_nothing(make_run):
    """A learning rate that blows the weights up: the first step is finite, the next mini-batch's
    loss is not, and the update stops there with one line instead of publishing a broken policy."""
    run = Path(make_run(train={"mini_batch_size": 8, "lr": 1e30}))
    proc = grpo("iterate", str(run), "--iters", "1", check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert len(errors) == 1 and re.fullmatch(
        r"error: update iteration 0: (loss/policy|grad_norm) is (nan|inf|-inf) at epoch 0 mini-batch 1; "
        r"nothing was published \(try a lower train.lr\)", errors[0]), errors
    assert not (run / "policy/iter-0001").exists()
    assert not (run / "iter-0000/update/MANIFEST.json").exists()
    assert (run / "iter-0000/logprobs/MANIFEST.json").exists()  # what came before stands
