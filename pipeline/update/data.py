"""The update's training rows: iteration k's rollout, score and logprobs parts joined on
(prompt_id, sample_idx), with KL folded into the rewards when `advantages.kl_in_reward` asks."""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa
import torch

from pipeline.objective import loss as grpo
from pipeline.objective.advantages import advantages_of
from pipeline.config import Config
from pipeline.errors import GRPOError
from pipeline.models.tokens import Batch
from pipeline.run.parts import read_parts
from pipeline.run.run import Run
from schemas.artifacts import LOGPROBS, ROLLOUT, SCORE


def model_tokens(completion_ids: list, masks: list) -> np.ndarray:
    """Each row's tokens the loss counts: its episode mask's ones (None: every token sampled), the
    mask `Batch.build` gives the loss, so a normaliser built from these (DAPO's num_items) counts the
    tokens its numerator sums and no token masked after sampling (TRL #6369)."""
    return np.array([len(c) if m is None else int(sum(m)) for c, m in zip(completion_ids, masks)])


class UpdateData:
    """Iteration k's training rows: rollout + score + logprobs joined on (prompt_id, sample_idx)."""

    def __init__(self, run: Run, k: int, kl_ctl=None):
        cfg = run.cfg
        from pipeline.schedule import iteration_plan

        # one optimizer step per epoch: the old logprobs are the first epoch's forward, detached (recorded by `record_old`)
        self.old_from_update = iteration_plan(cfg, k).old_from_update
        roll = pl.from_arrow(pa.concat_tables(read_parts(run, k, "rollout", ROLLOUT)).select(
            ["prompt_id", "sample_idx", "prompt_ids", "completion_ids", "sampler_logprobs", "completion_mask"]))
        score = pl.from_arrow(pa.concat_tables(read_parts(run, k, "score", SCORE)).select(["prompt_id", "sample_idx", "reward", "advantage", "train"]))
        lp = pl.from_arrow(pa.concat_tables(read_parts(run, k, "logprobs", LOGPROBS)).select(["prompt_id", "sample_idx", "old_logprobs", "ref_logprobs"]))
        # the rollout's row order, explicitly: rows are regrouped in blocks of G below (polars leaves a join's order unspecified)
        key = ["prompt_id", "sample_idx"]
        df = roll.join(score, on=key, how="inner", maintain_order="left").join(lp, on=key, how="inner", maintain_order="left")
        if df.height != roll.height:
            raise GRPOError(f"update iteration {k}: rollout, score and logprobs parts do not join ({roll.height} rollout rows, {df.height} joined)")
        _check_masks(df, k)
        self.kl_stats = None
        if cfg.advantages.kl_in_reward.coef > 0 and kl_ctl is not None:
            df = self._kl_in_reward(df, cfg, kl_ctl)
        df = df.filter(pl.col("train"))
        self.df = df
        self.size = df.height
        self.prompt_ids = df["prompt_ids"].to_list()
        self.prompt_key = df["prompt_id"].to_numpy()  # rows of one group share their prompt
        self.completion_ids = df["completion_ids"].to_list()
        self.masks = df["completion_mask"].to_list()  # a row's episode mask, None: every token sampled
        self.sampler = df["sampler_logprobs"].to_list()
        self.corrects = cfg.loss.rollout_correction.mode != "none"
        self.old = df["old_logprobs"].to_list()
        if not self.old_from_update and any(o is None for o in self.old):
            raise GRPOError(f"update iteration {k}: the logprobs parts have no old_logprobs (made with another train.old_logprobs)")
        self.used_old: dict[int, np.ndarray] = {}  # row -> the old logprobs the update's forward gave
        self.ref = df["ref_logprobs"].to_list()
        self.adv = torch.tensor(df["advantage"].to_numpy(), dtype=torch.float32)
        # what the loss counts per row: the tokens the model sampled (the token type's units, DAPO's num_items)
        self.model_tokens = model_tokens(self.completion_ids, self.masks)

    def _kl_in_reward(self, df: pl.DataFrame, cfg: Config, kl_ctl) -> pl.DataFrame:
        """Fold KL(policy_old || ref) into each reward, then recompute group advantages."""
        G = cfg.rollout.num_generations
        comps = df["completion_ids"].to_list()
        batch = Batch.build([[0]] * len(comps), comps, episode_masks=df["completion_mask"].to_list())
        T = batch.completion_mask.shape[1]
        old = _pad(df["old_logprobs"].to_list(), T)
        ref = _pad(df["ref_logprobs"].to_list(), T)
        scores = torch.tensor(df["reward"].fill_null(float("nan")).to_numpy(), dtype=torch.float64)
        penalised = grpo.kl_penalised_rewards(scores, old, ref, batch.loss_mask, kl_ctl.coef)
        adv = advantages_of(cfg.advantages, penalised.numpy(), G)
        kl_seq = ((old - ref) * batch.loss_mask).sum(-1)  # [N] k1 summed over the model's tokens
        self.kl_stats = float(kl_seq.mean())
        return df.with_columns(pl.Series("advantage", adv.astype(np.float32)))

    def mask_sum(self, idx) -> int:
        """Tokens the model sampled in rows `idx`."""
        return int(self.model_tokens[idx].sum())

    def batch(self, idx, share_prompts: bool = True, packed: bool = False):
        """(batch, old [B, T] or None when this forward gives them (first epoch), ref or None,
        advantages, sampler [B, T] or None when no `loss.rollout_correction` needs them)."""
        b = Batch.build([self.prompt_ids[i] for i in idx], [self.completion_ids[i] for i in idx], share_prompts=share_prompts,
                        episode_masks=[self.masks[i] for i in idx], packed=packed)
        T = b.completion_mask.shape[1]
        if self.old_from_update:
            recorded = [int(i) in self.used_old for i in idx]
            if any(recorded) and not all(recorded):
                raise GRPOError(f"update: {recorded.count(False)} of {len(idx)} rows have no recorded old logprobs")
            old = _pad([self.used_old[int(i)] for i in idx], T) if all(recorded) else None
        else:
            old = _pad([self.old[i] for i in idx], T)
        ref = _pad([self.ref[i] for i in idx], T) if self.ref[idx[0]] is not None else None
        sampler = _pad([self.sampler[i] for i in idx], T) if self.corrects else None
        return b, old, ref, self.adv[torch.as_tensor(idx)], sampler


    def record_old(self, idx, logp: torch.Tensor) -> None:
        """Keep the detached logprobs [B, T] of rows `idx` that stood in for the old ones."""
        logp = logp.detach().float().cpu()
        for j, i in enumerate(idx):
            self.used_old[int(i)] = logp[j, : len(self.completion_ids[i])].numpy().copy()

    def old_table(self) -> pa.Table:
        """The old logprobs the update used (every trained row), as a LOGPROBS table."""
        from pipeline.logprobs import old_logprobs_table

        missing = [i for i in range(self.size) if i not in self.used_old]
        if missing:
            raise GRPOError(f"update: {len(missing)} rows got no old logprobs from the update's forward")
        order = self.df.select(["prompt_id", "sample_idx"]).with_row_index("row").sort(["prompt_id", "sample_idx"])
        rows = order["row"].to_list()
        return old_logprobs_table(pa.array(order["prompt_id"].to_list(), pa.int64()), pa.array(order["sample_idx"].to_list(), pa.int32()),
                                  [self.used_old[i] for i in rows], [self.sampler[i] for i in rows],
                                  masks=[self.masks[i] for i in rows])


def _pad(rows: list[list[float]], T: int) -> torch.Tensor:
    out = torch.zeros((len(rows), T), dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out


def _check_masks(df: pl.DataFrame, k: int) -> None:
    """Every episode mask is 0/1 and as long as its completion: a one-line error naming the row."""
    for pid, j, comp, m in zip(df["prompt_id"], df["sample_idx"], df["completion_ids"], df["completion_mask"]):
        if m is not None and (len(m) != len(comp) or any(v not in (0, 1) for v in m)):
            raise GRPOError(f"update iteration {k}: rollout row prompt_id {pid} sample_idx {j}: completion_mask must be "
                            f"{len(comp)} values of 0 or 1 (one per completion token), got {len(m)} ({sorted(set(m))[:4]})")
