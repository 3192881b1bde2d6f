"""Multi-turn episodes downstream of the rollout: where a row's `completion_mask` is non-null only
the tokens the model sampled (mask 1) count, in the loss of every type, KL-in-reward, the sampler
gap, the token counts and the metrics; the model still reads (and the stages still score) the
tool tokens. Hand-computed values with the arithmetic in the comments."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import padded
import torch
from test_grpo import CONFIGS, naive_policy_loss

from pipeline.errors import GRPOError
from pipeline.objective.loss import kl_penalised_rewards, policy_loss
from pipeline.config.loss import LossConfig
from pipeline.logprobs import old_logprobs_table, sampler_gaps
from pipeline.models.tokens import Batch

LN = math.log


def close(actual, expected, atol=1e-6):
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert torch.allclose(torch.as_tensor(actual).double(), expected, atol=atol, rtol=0), (actual, expected)


def episode_batch():
    """Row 0: an episode of 5 tokens, the model sampled 0 and 3 (log-ratios ln 1.1 and ln 0.9, logprobs
    -1 and -0.5), a tool result sits at 1, 2 and 4 (logprobs computed there, far from the old ones).
    Row 1: a plain completion of 3 tokens (log-ratios 0, ln 1.05, ln 0.95, logprobs -0.2, -0.4, -0.6)
    padded to 5. Advantages (1, -2)."""
    logp = torch.tensor([[-1.0, 50.0, 3.0, -0.5, 40.0], [-0.2, -0.4, -0.6, 0.0, 0.0]], dtype=torch.float64)
    log_ratio = torch.tensor([[LN(1.1), 100.0, -9.0, LN(0.9), 80.0], [0.0, LN(1.05), LN(0.95), 0.0, 0.0]], dtype=torch.float64)
    mask = Batch.build([[7], [7]], [[1, 2, 3, 4, 5], [6, 7, 8]], episode_masks=[[1, 0, 0, 1, 0], None]).loss_mask
    return logp, logp - log_ratio, torch.tensor([1.0, -2.0], dtype=torch.float64), mask


@pytest.mark.parametrize("cfg, kwargs, expected", [
    # per-token losses over the model's tokens (ratios inside [0.8, 1.2], so -min(rA, clip(r)A) = -rA):
    #   row 0 (A = 1):  -1.1, -0.9           sum -2.0 over 2 tokens
    #   row 1 (A = -2):  2.0, 2.1, 1.9       sum  6.0 over 3 tokens
    # grpo: (-2/2 + 6/3) / 2 = 0.5          (the 3 tool tokens in row 0's count would give (-0.4 + 2) / 2 = 0.8)
    (LossConfig(type="grpo"), {}, 0.5),
    # bnpo: (-2 + 6) / 5 = 0.8             (with the tool tokens counted: 4 / 8 = 0.5)
    (LossConfig(type="bnpo"), {}, 0.8),
    # dr_grpo: (-2 + 6) / (2 x 5) = 0.4
    (LossConfig(type="dr_grpo"), {"max_completion_length": 5}, 0.4),
    # dapo, num_items = 8 model tokens in the generation batch: 4 / 8 = 0.5
    (LossConfig(type="dapo"), {"num_items": 8}, 0.5),
    # reinforce: -(1/2) [1 x (-1 - 0.5) + (-2) x (-0.2 - 0.4 - 0.6)] = -(1/2)(-1.5 + 2.4) = -0.45
    (LossConfig(type="reinforce"), {}, -0.45),
    # GSPO: row 0's ratio is the geometric mean over its 2 model tokens sqrt(1.1 x 0.9) = sqrt(0.99) = 0.994987,
    # row 1's (1 x 1.05 x 0.95)^(1/3) = 0.9975^(1/3) = 0.999166; grpo: (-0.994987 + 2 x 0.999166) / 2 = 0.501672
    (LossConfig(type="grpo", importance_level="sequence"), {}, 0.501672),
])
def test_every_loss_type_counts_the_model_tokens_only(cfg, kwargs, expected):
    logp, old, adv, mask = episode_batch()
    loss, metrics = policy_loss(logp.clone().requires_grad_(), old, adv, mask, cfg, **kwargs)
    close(loss, expected)
    if cfg.type != "reinforce" and cfg.importance_level == "token":
        # per-token metrics over the 5 model tokens: ratios (1.1, 0.9, 1, 1.05, 0.95), mean 1.0
        assert metrics["ratio/mean"] == pytest.approx(1.0)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.type}-{c.importance_level}-{c.kl_estimator}-kl{c.kl_coef}-d{c.delta}")
def test_an_episode_batch_is_its_model_tokens_alone(cfg):
    """Loss, gradients and metrics of an episode batch equal those of the batch holding only its
    model tokens (the loss is blind to positions), and the naive loop's; tool tokens get no gradient."""
    gen = torch.Generator().manual_seed(3)
    B, T = 4, 9
    lengths = [9, 6, 0, 4]
    episode = [[1, 1, 0, 0, 0, 1, 1, 0, 1], [0, 0, 1, 1, 1, 1], [], None]  # row 0 and 1 are episodes, row 3 plain
    mask = Batch.build([[1]] * B, [[5] * n for n in lengths], episode_masks=episode).loss_mask.bool()
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    logp = old + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.4
    ref = old + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.3
    entropy = torch.rand(B, T, generator=gen, dtype=torch.float64) * 2
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    n_items = int(mask.sum()) + 5
    kw = dict(max_completion_length=9, num_items=n_items)

    # the compact batch: each row's model tokens moved to the front, nothing else
    n = mask.sum(1)
    compact = torch.arange(T).unsqueeze(0) < n.unsqueeze(1)  # [B, T]

    def pack(x):
        out = torch.zeros_like(x)
        out[compact] = x[mask]
        return out

    results = []
    for m, lp, o, r, e in ((mask, logp, old, ref, entropy), (compact, pack(logp), pack(old), pack(ref), pack(entropy))):
        lp, e = lp.clone().requires_grad_(), e.clone().requires_grad_()
        loss, metrics = policy_loss(lp, o, adv, m, cfg, ref_logprobs=r, entropy=e, **kw)
        loss.backward()
        results.append((loss.detach(), metrics, lp.grad, e.grad, lp, o, r, e))
    (l1, m1, g1, ge1, *_), (l2, m2, g2, ge2, lp2, o2, r2, e2) = results
    close(l1, l2, atol=1e-12)
    assert m1 == pytest.approx(m2, abs=1e-12)
    close(g1[mask], g2[compact], atol=1e-12)
    assert g1[~mask].abs().sum() == 0
    if cfg.entropy_coef > 0:
        close(ge1[mask], ge2[compact], atol=1e-12)
    naive = naive_policy_loss(lp2.detach(), o2, adv, compact, cfg, r2, 9, n_items, e2.detach())
    close(l1, naive, atol=1e-10)


def test_garbage_on_masked_tokens_changes_nothing():
    """NaN, inf and huge values where the episode mask is 0 (in logprobs, old, ref, entropy, the
    sampler's) leave the loss, the metrics and the gradient exactly as they were."""
    from pipeline.config.loss import RolloutCorrection

    logp, old, adv, mask = episode_batch()
    ref, ent, sampler = old - 0.1, torch.full_like(old, 0.7), old + 0.05
    cfg = LossConfig(kl_coef=0.1, entropy_coef=0.01, rollout_correction=RolloutCorrection(mode="token_truncate"))
    tool = ~mask.bool()
    tool[1] = False  # row 1's padding stays 0 in both
    outs = []
    for dirty in (False, True):
        tensors = [x.clone() for x in (logp, old, ref, ent, sampler)]
        if dirty:
            for x, junk in zip(tensors, (1e30, float("nan"), -float("inf"), float("nan"), 1e30)):
                x[tool] = junk
        lp = tensors[0].requires_grad_()
        loss, metrics = policy_loss(lp, tensors[1], adv, mask, cfg, ref_logprobs=tensors[2], entropy=tensors[3],
                                    sampler_logprobs=tensors[4])
        loss.backward()
        outs.append((loss.detach(), metrics, lp.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and outs[0][1] == outs[1][1] and torch.equal(outs[0][2], outs[1][2])
    assert torch.isfinite(outs[1][2]).all() and outs[1][2][tool].abs().sum() == 0


def test_kl_in_reward_sums_the_model_tokens_only():
    # row 0: k1 = logp - ref over the model's tokens 0 and 3: (-1 + 1.5) + (-2 + 1) = -0.5 -> 1 - 0.1 x (-0.5) = 1.05
    # (the tool token at 1, k1 = 4 - 0 = 4, would make it 1 - 0.1 x 3.5 = 0.65)
    logp = torch.tensor([[-1.0, 4.0, 0.0, -2.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, 0.0, 0.0, -1.0]], dtype=torch.float64)
    mask = Batch.build([[9]], [[1, 2, 3, 4]], episode_masks=[[1, 0, 1, 1]]).loss_mask
    mask[0, 2] = 0  # and a second model-masked position, by hand
    close(kl_penalised_rewards(torch.tensor([1.0], dtype=torch.float64), logp, ref, mask, 0.1), [1.05])


def test_the_batch_keeps_the_length_mask_for_the_model_and_the_product_for_the_loss():
    b = Batch.build([[1, 2], [3]], [[4, 5, 6, 7], [8, 9]], episode_masks=[[1, 0, 0, 1], None])
    assert b.completion_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]  # the model reads and scores every token
    assert b.loss_mask.tolist() == [[1, 0, 0, 1], [1, 1, 0, 0]]
    plain = Batch.build([[1, 2], [3]], [[4, 5, 6, 7], [8, 9]])
    assert plain.loss_mask is plain.completion_mask  # a plain batch: the same tensor, the same numbers as before
    moved = b.to("cpu")
    assert torch.equal(moved.loss_mask, b.loss_mask)


def test_tool_tokens_are_context_whose_logprobs_are_still_computed():
    """The logprobs of an episode are those of its whole completion: the model reads the tool
    result, so the model tokens after it see it; its own positions are scored too."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.models.tokens import token_logprobs

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=30, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)).eval()
    prompts, comps = [[1, 2], [1, 2]], [[3, 4, 5, 6, 7], [3, 9, 9, 6, 7]]  # row 1: another tool result at 1-2
    with torch.no_grad():
        for share in (False, True):
            ep = Batch.build(prompts, comps, episode_masks=[[1, 0, 0, 1, 1], [1, 0, 0, 1, 1]], share_prompts=share)
            logp, _ = token_logprobs(model, ep, 1.0)
            plain, _ = token_logprobs(model, Batch.build(prompts, comps, share_prompts=share), 1.0)
            assert torch.equal(logp, plain) and (logp != 0).all()
            assert (logp[0, 3:] - logp[1, 3:]).abs().max() > 1e-4  # token 3 onwards read what the tool said


def test_the_sampler_gap_counts_the_model_tokens_only():
    # old (-1, -2, -3, -4), sampler (-1.1, 0, 0, -3.5) (0.0: a tool result's), mask (1, 0, 0, 1): gaps 0.1 and 0.5
    old = [np.array([-1, -2, -3, -4], np.float32), np.array([-1, -2], np.float32), np.array([], np.float32)]
    sampler = [[-1.1, 0.0, 0.0, -3.5], [-1.25, -2.0], []]
    masks = [[1, 0, 0, 1], None, []]
    gaps = sampler_gaps(old, sampler, masks)
    close(gaps[0], [0.1, 0.5])
    close(gaps[1], [0.25, 0.0])  # a plain completion: every token
    close(gaps[2], [0.0])
    t = old_logprobs_table(pa.array([0, 0, 1]), pa.array([0, 1, 0], pa.int32()), old, sampler, masks=masks)
    close(t.column("sampler_gap_mean").to_pylist(), [0.3, 0.125, 0.0])
    close(t.column("sampler_gap_max").to_pylist(), [0.5, 0.25, 0.0])
    # no masks: the same bytes as before episodes existed
    before = old_logprobs_table(pa.array([0, 0, 1]), pa.array([0, 1, 0], pa.int32()), old, sampler)
    assert before.equals(old_logprobs_table(pa.array([0, 0, 1]), pa.array([0, 1, 0], pa.int32()), old, sampler, masks=[None] * 3))
    close(before.column("sampler_gap_mean").to_pylist(), [(0.1 + 2 + 3 + 0.5) / 4, 0.125, 0.0])


def test_a_bad_episode_mask_is_a_one_line_error_naming_the_row():
    from pipeline.update.data import _check_masks

    df = pl.DataFrame({"prompt_id": [3, 3], "sample_idx": [0, 1], "completion_ids": [[1, 2, 3], [4, 5]],
                       "completion_mask": [[1, 0, 1], [1, 2]]}, schema_overrides={"completion_mask": pl.List(pl.Int8)})
    with pytest.raises(GRPOError, match=r"update iteration 2: rollout row prompt_id 3 sample_idx 1: completion_mask must be 2 values of 0 or 1"):
        _check_masks(df, 2)
    _check_masks(df.head(1), 2)
    short = df.with_columns(pl.Series("completion_mask", [[1, 0], None], pl.List(pl.Int8)))
    with pytest.raises(GRPOError, match="prompt_id 3 sample_idx 0: completion_mask must be 3 values"):
        _check_masks(short, 0)


def test_a_version_1_update_metrics_part_reads_with_the_correction_columns_as_nulls(tmp_path):
    from pipeline.store import RunStore
    from schemas.artifacts import ROLLOUT_CORRECTION_METRICS, UPDATE_METRICS

    row = {n: 1.0 for n in UPDATE_METRICS.schema.names} | {"step": 1, "epoch": 0, "batch": 0, "tokens": 10}
    v2 = UPDATE_METRICS.conform(pa.Table.from_pylist([row]))
    v1 = v2.drop(list(ROLLOUT_CORRECTION_METRICS))
    pq.write_table(v1.replace_schema_metadata(dict(v2.schema.metadata) | {b"grpo.schema_version": b"1"}), tmp_path / "m.parquet")
    t = RunStore(tmp_path).read_table("m.parquet", UPDATE_METRICS)
    assert t.column_names == UPDATE_METRICS.schema.names
    assert all(t.column(n).to_pylist() == [None] for n in ROLLOUT_CORRECTION_METRICS)
    assert t.column("loss/policy").to_pylist() == [1.0]


# --------------------------------------------------------------------------- the stages, on real engines


@pytest.mark.slow
def test_stages_honour_an_episode_rollout(assets, make_run):
    """A real rollout turned into episodes (tokens 2-4 of each completion declared a tool result:
    mask 0, sampler logprob 0.0), then the real score, logprobs and update stages. A tool token's
    0.0 against its real logprob (several nats) would show in the sampler gap, in the rollout
    correction's weight and in the token counts; none does, and the first step's loss is
    `policy_loss` over the model's tokens, recomputed from the parts."""
    from pipeline.logprobs import run_logprobs
    from pipeline.run.policy import load_model
    from pipeline.models.tokens import token_logprobs
    from pipeline.rollout import RolloutInputs, run_rollout
    from pipeline.score import run_score
    from pipeline.run.parts import Shard, read_part, run_parts
    from pipeline.run.run import Run
    from pipeline.update.publish import run_update
    from schemas.artifacts import ROLLOUT

    sections = dict(train={"mini_batch_size": 8, "lr": 3e-4, "epochs": 2}, loss={"kl_coef": 0.05})
    source, episodes = Run(make_run("source", **sections)), Run(make_run("episodes", **sections))
    run_rollout(source, 0)
    src_m = source.manifest(0, "rollout")

    def as_episodes(part: int) -> pa.Table:
        rows = read_part(source, 0, "rollout", ROLLOUT, part).to_pylist()
        for r in rows:
            n = len(r["completion_ids"])
            mask = [0 if 2 <= t < 5 and n > 6 else 1 for t in range(n)]
            r["completion_mask"] = mask
            r["sampler_logprobs"] = [lp if m else 0.0 for lp, m in zip(r["sampler_logprobs"], mask)]
        return pa.Table.from_pylist(rows)

    plan = RolloutInputs(episodes, 0)
    extra = {f: getattr(src_m, f) for f in ("policy_hash", "engine", "engine_dtype", "stats", "trainer_state")}
    run_parts(episodes, 0, "rollout", ROLLOUT, plan.num_parts, Shard(), plan.inputs(), as_episodes, manifest_extra=lambda: extra)
    run_score(episodes, 0)
    run_logprobs(episodes, 0)
    _, trainer = run_update(episodes, 0)
    trainer.close()

    it = Path(episodes.uri) / "iter-0000"
    df = (pl.read_parquet(it / "rollout/*.parquet").join(pl.read_parquet(it / "score/*.parquet"), on=["prompt_id", "sample_idx"])
          .join(pl.read_parquet(it / "logprobs/*.parquet"), on=["prompt_id", "sample_idx"]))
    assert df["completion_mask"].list.sum().sum() < df["completion_length"].sum()  # the episodes do hide tokens
    # the sampler gap over the model's tokens: fp32 engine and trainer agree to ~1e-5 (a tool token's would be nats)
    assert df["sampler_gap_max"].max() < 1e-3
    steps = pl.read_parquet(it / "update/metrics.parquet")
    assert steps["rollout_correction/clipped_frac"].max() == 0.0
    assert (steps["rollout_correction/ratio_min"] > 0.999).all() and (steps["rollout_correction/ratio_max"] < 1.001).all()
    # token counts: each optimizer step's mini-batch, in the update's order, counts its model tokens
    trained = df.filter(pl.col("train"))
    cfg = episodes.cfg
    for row in steps.iter_rows(named=True):
        order = np.random.default_rng([cfg.seed, 0, row["epoch"]]).permutation(trained.height)
        mb = trained[order[row["batch"] * 8 : (row["batch"] + 1) * 8].tolist()]
        assert row["tokens"] == int(mb["completion_mask"].list.sum().sum())

    # the first step's loss from the parts: policy_loss over the model's tokens, with the sampler's weight
    first = steps.row(0, named=True)
    rows = trained[np.random.default_rng([cfg.seed, 0, 0]).permutation(trained.height)[:8].tolist()]
    batch = Batch.build(rows["prompt_ids"].to_list(), rows["completion_ids"].to_list(), episode_masks=rows["completion_mask"].to_list())
    T = batch.completion_mask.shape[1]

    def pad(col):
        return padded(rows[col].to_list(), T)

    with torch.no_grad():
        logp, entropy = token_logprobs(load_model(Path(episodes.uri) / "policy/iter-0000"), batch, cfg.rollout.temperature, with_entropy=True)
    _, metrics = policy_loss(logp, pad("old_logprobs"), torch.tensor(rows["advantage"].to_numpy()), batch.loss_mask, cfg.loss,
                             ref_logprobs=pad("ref_logprobs"), max_completion_length=cfg.rollout.max_new_tokens,
                             num_items=int(batch.loss_mask.sum()), entropy=entropy, sampler_logprobs=pad("sampler_logprobs"))
    for key in ("loss/policy", "kl/mean", "entropy/mean", "rollout_correction/ratio_mean"):
        assert metrics[key] == pytest.approx(first[key], abs=1e-5), key
    assert first["tokens"] == int(batch.loss_mask.sum())
