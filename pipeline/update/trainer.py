"""The DeepSpeed trainer of the update stage: one engine over the policy (or its LoRA adapter),
kept alive across iterations by `iterate`; `pipeline.update.publish` drives it.

`train.epochs` passes over the shuffled completions, `train.mini_batch_size` completions per
optimizer step split into `train.grad_accum` micro-batches (and those into pieces of at most
`train.update_token_budget` tokens); the loss is `pipeline.objective.loss.policy_loss`, aggregated as the
loss type's `LossType` object says. Single process here; under `deepspeed` / `torchrun` each rank
takes its slice of every mini-batch (data parallel, same global batch).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from pipeline.objective import loss as grpo
from pipeline.config import Config
from pipeline.errors import GRPOError
from pipeline.models import packing
from pipeline.run.policy import policy_kind
from pipeline.models.tokens import resolve_precision, shared_budget_batches, token_logprobs
from pipeline.schedule import steps_per_iter
from pipeline.progress import progress
from pipeline.quiet import captured
from pipeline.objective.correction import combine
from pipeline.objective.kl import make_kl_controller
from pipeline.update.step_metrics import across_ranks
from pipeline.update.distributed import close_distributed, deepspeed_env, ds_config, init_distributed
from pipeline.update.determinism import piece_attention, serial_accumulation, update_rng
from pipeline.update.threads import update_threads
from schemas.artifacts import STEP_METRICS

if TYPE_CHECKING:
    from pipeline.update.data import UpdateData

STATE = "state"
TRAINER_JSON = "trainer.json"


def lr_lambda(cfg: Config):
    t = cfg.train
    horizon = max(1, t.total_iters * steps_per_iter(cfg))

    def f(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        frac = min(1.0, (step - t.warmup_steps) / max(1, horizon - t.warmup_steps))
        if t.lr_schedule == "linear":
            return 1.0 - frac
        if t.lr_schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * frac))
        return 1.0

    return f


class Trainer:
    """A DeepSpeed engine over the policy, kept alive across iterations by `iterate`."""

    @deepspeed_env
    def __init__(self, cfg: Config, policy_dir: Path, state_dir: Path | None, base_dir: Path | None = None):
        """`base_dir`: policy 0, the base a LoRA policy's adapter sits on (unused for whole weights)."""
        import deepspeed

        from pipeline.models import fused
        from pipeline.models.engines import cpu_env
        from pipeline.models.kernels import same_kernels_every_run

        cpu_env()
        same_kernels_every_run()  # bit-identical updates on a GPU too
        self.cfg = cfg
        self.policy = policy_kind(cfg)
        self.precision = resolve_precision(cfg.train.precision)
        self.rank, self.world = init_distributed()
        torch.manual_seed(cfg.seed)
        model = self.policy.train_model(policy_dir, base_dir, self.precision)  # LoRA: only the adapter trains
        model.config.use_cache = False
        if cfg.train.gradient_checkpointing:  # layers recompute in the backward (under engine.train())
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        fused.lean_activations(model)  # same forward, ~0.3 GB less kept for the backward per 1024 tokens
        with captured():  # DeepSpeed prints its config on stdout (it joins vLLM's process group here)
            self.engine, _, _, self.scheduler = self._initialize(deepspeed, model, cfg)
        self.global_step = 0
        self.published: tuple[Path, dict, set | None] | None = None  # the last saved policy's weights and names (save_policy)
        self.clean_after: int | None = -1
        """The iteration whose update this trainer's state is the result of (-1: none yet; None:
        mid-update, no iteration's), what `pipeline.update.publish.flush_state` writes."""
        self.packed = packing.resolve(cfg.train.packing, model)  # padding-free pieces (pipeline.models.packing)
        # a checkpointed layer cannot write the padded path's shared-prompt KV cache; a packed piece needs none
        self.share_prompts = self.packed or not cfg.train.gradient_checkpointing
        a = cfg.advantages.kl_in_reward
        self.kl_ctl = make_kl_controller(a.coef, a.target, a.horizon)
        if state_dir is not None:
            self.load_state(state_dir)

    def _initialize(self, deepspeed, model, cfg: Config):
        return deepspeed.initialize(
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=ds_config(cfg, self.world),
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg)),
        )

    # -- state ---------------------------------------------------------------------------
    @deepspeed_env
    def save_state(self, out: Path) -> None:
        # LoRA: the frozen base is policy 0; the state holds the adapter and its optimizer only.
        # No zip CRC32 in torch.save: 0.98 -> 0.45 s for SmolLM2-135M's 1.6 GB state (page cache
        # warm), and the run's sha256 of every file (outputs.state in the manifest) covers integrity
        from torch.utils.serialization import config as serialization

        with serialization.patch({"save.compute_crc32": False}):
            self.engine.save_checkpoint(str(out), tag="state", save_latest=False,
                                        exclude_frozen_parameters=self.policy.frozen_base)
        if self.rank == 0:
            (out / TRAINER_JSON).write_text(json.dumps({"global_step": self.global_step, "kl_controller": self.kl_ctl.state_dict()}, sort_keys=True))

    @deepspeed_env
    def load_state(self, src: Path) -> None:
        path, _ = self.engine.load_checkpoint(str(src), tag="state", load_module_strict=not self.policy.frozen_base)
        if path is None:
            raise GRPOError(f"{src}: trainer state could not be loaded")
        meta = json.loads((src / TRAINER_JSON).read_text())
        self.global_step = meta["global_step"]
        self.kl_ctl.load_state_dict(meta["kl_controller"])

    @deepspeed_env
    def save_policy(self, out: Path, src_dir: Path, ckpt: Path, later: bool = False):
        """Policy K+1 as the policy object saves it (a plain HF model dir, or a LoRA adapter) from
        the fp32 master weights: views of the optimizer's own where they are whole in this process
        (pipeline.update.weights), consolidated from the checkpoint `ckpt` under ZeRO-3 or several
        ranks. Returns {file: sha256} of the files hashed as they were written, or, with `later`,
        where the weights are streamed, what their file is left to (pipeline.run.weights_file; not hashed yet)."""
        from pipeline.run.weights_file import names_to_write
        from pipeline.update.weights import fp32_masters, master_state_dict

        module, t = self.engine.module, self.cfg.train
        masters = fp32_masters(self.engine, self.world, t.zero_stage)
        if masters is not None:
            state = master_state_dict(module, masters)
        elif t.bf16 and t.zero_stage >= 1:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="state")
        elif t.zero_stage == 3:
            state = self.engine._zero3_consolidated_16bit_state_dict()
        else:
            state = None
        if self.rank != 0:
            return {}
        hashed = self.policy.save(module, out, src_dir, state, later) or {}  # whole weights, or the LoRA adapter
        if self.cfg.rollout.weight_sync == "memory" or (later and self.cfg.weight_sync == "memory"):  # full weights (no LoRA); auto: for iterate's engine here
            names = names_to_write(hashed)  # as the file will name them
            self.published = (out, state if state is not None else module.state_dict(), names)
        return hashed

    def published_weights(self, policy_dir: Path) -> list | None:
        """rollout.weight_sync memory: the weights `save_policy` wrote, once published as
        `policy_dir`, as (name, tensor) pairs named as its safetensors files name them; else None.
        They are handed over once (the reference is dropped)."""
        if self.published is None or self.published[0] != Path(policy_dir):
            return None
        from safetensors import safe_open

        _, state, names = self.published
        if names is None:  # written already: named as its files name them
            names = set()
            for f in sorted(Path(policy_dir).glob("*.safetensors")):
                with safe_open(f, "pt") as st:
                    names.update(st.keys())
        self.published = None
        return [(n, t.detach()) for n, t in state.items() if n in names]

    def close(self) -> None:
        self.published = None
        close_distributed()

    # -- one iteration -------------------------------------------------------------------
    @deepspeed_env
    def train_iteration(self, data: "UpdateData", k: int) -> list[dict]:
        t = self.cfg.train
        n, rows = data.size, []
        if n == 0:
            return rows
        self.engine.train()
        steps = t.epochs * -(-n // t.mini_batch_size)
        dev = self.engine.device
        with (progress(f"update iteration {k} optimizer steps", steps) as bar, serial_accumulation(dev), update_threads(dev),
              update_rng(dev, self.cfg.seed, k, self.rank)):  # dropout draws as on any path to update k
            for epoch in range(t.epochs):
                rows += self._epoch(data, k, epoch, bar)
                if epoch == 0 and data.old_from_update and self.world > 1:
                    # each rank recorded its own rows' old logprobs; the next epoch deals rows out anew
                    every: list = [None] * self.world
                    torch.distributed.all_gather_object(every, data.used_old)
                    for part in every:
                        data.used_old.update(part)
        return rows

    def _epoch(self, data: "UpdateData", k: int, epoch: int, bar) -> list[dict]:
        cfg, t = self.cfg, self.cfg.train
        n, rows = data.size, []
        order = np.random.default_rng([cfg.seed, k, epoch]).permutation(n)
        for b, start in enumerate(range(0, n, t.mini_batch_size)):
            mb = order[start : start + t.mini_batch_size]
            tokens = int(data.mask_sum(mb))
            lr = float(self.scheduler.get_last_lr()[0]) if self.scheduler else t.lr
            acc = self.accumulate(data, mb)
            pre_norm = self._grad_norm()
            for key, v in (("loss/policy", acc.get("loss/policy", 0.0)), ("grad_norm", pre_norm or 0.0)):
                if not math.isfinite(v):  # stepping would write non-finite weights into the next policy
                    raise GRPOError(f"update iteration {k}: {key} is {v} at epoch {epoch} mini-batch {b}; "
                                    "nothing was published (try a lower train.lr)")
            self.engine.step()
            self.global_step += 1
            grad_norm = self.engine.get_global_grad_norm()
            grad_norm = pre_norm if grad_norm is None else grad_norm
            rows.append(
                {
                    "step": self.global_step, "epoch": epoch, "batch": b,
                    **{key: acc.get(key, float("nan")) for key in STEP_METRICS},
                    "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                    "lr": lr,
                    "tokens": tokens,
                }
            )
            bar.advance()
        return rows

    @property
    def loss_kind(self) -> grpo.LossType:
        """How the loss type weighs rows and tokens (of `self.cfg`, which a caller may swap)."""
        return grpo.loss_type(self.cfg.loss)

    def accumulate(self, data: "UpdateData", mb: np.ndarray) -> dict[str, float]:
        """Forward and backward of mini-batch `mb` in micro-batches of `train.mini_batch_size //
        train.grad_accum` rows (the last one short when `mb` is): its gradient accumulated, not
        stepped. Returns its metrics."""
        cfg, t = self.cfg, self.cfg.train
        micro, acc = t.mini_batch_size // t.grad_accum, {}
        tokens = int(data.mask_sum(mb))
        micros = [mb[i : i + micro] for i in range(0, len(mb), micro)]
        for j, mi in enumerate(micros):
            # the boundary is set by hand so a short last mini-batch still steps
            self.engine.set_gradient_accumulation_boundary(j == len(micros) - 1)
            mine = mi[self.rank :: self.world]  # this rank's slice of the micro-batch
            # the micro-batch's share of the mini-batch as the loss type weighs it (rows or tokens),
            # so an uneven split (a short last mini-batch cut [6, 2]) gives the unsplit gradient
            share_tokens = data.mask_sum(mi) / max(1, tokens)
            share = self.loss_kind.micro_batch_share(len(mi) / len(mb), share_tokens, len(micros))
            weight = self._rank_weight(data, mine, mi) * share
            # a rank with no rows (short last mini-batch) joins the all-reduces with a zero-weight row
            metrics = self.micro_step(data, mine if len(mine) else mi[:1], tokens, weight)
            metrics = self._across_ranks(metrics, len(mine), data.mask_sum(mine) if len(mine) else 0)
            for key, v in metrics.items():  # mini-batch value: the loss as the type adds it up, token means over its tokens
                combine(acc, key, v, share if key.startswith("loss/") else share_tokens)
        return acc

    def _grad_norm(self) -> float | None:
        """Total gradient norm before clipping; ZeRO >= 1 optimizers report it themselves."""
        if self.cfg.train.zero_stage > 0:
            return None
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0

    def _rank_weight(self, data: "UpdateData", mine: np.ndarray, mi: np.ndarray) -> float:
        """This rank's weight on its micro-batch loss, so the ranks' average is the whole
        micro-batch's loss even when a short last mini-batch splits unevenly (the loss type says how)."""
        return self.loss_kind.rank_weight(self.world, len(mine), len(mi), data.mask_sum(mine), data.mask_sum(mi))

    def _across_ranks(self, metrics: dict[str, float], rows: int, tokens: int) -> dict[str, float]:
        return across_ranks(metrics, rows, tokens, self.loss_kind, self.world)

    def micro_step(self, data: "UpdateData", idx: np.ndarray, mb_tokens: int, weight: float = 1.0) -> dict:
        """Forward and backward of one micro-batch, its loss times `weight` (its share of the
        mini-batch's loss, and this rank's of the micro-batch's) so that the accumulated gradient
        is that of the mini-batch's loss.

        A micro-batch over `train.update_token_budget` padded tokens (a prompt its rows share
        counted once) runs as several pieces, each
        loss weighted by its share of what the loss type averages over (`LossType.piece_share`),
        so the summed gradient and the metrics are the whole micro-batch's."""
        cfg = self.cfg
        idx = idx[np.argsort(data.prompt_key[idx], kind="stable")]  # a group's rows side by side: its prompt runs once per piece
        pieces = [idx[list(p)] for p in shared_budget_batches([data.prompt_ids[i] for i in idx], [data.completion_ids[i] for i in idx],
                                                              cfg.train.update_token_budget, shared=self.share_prompts, packed=self.packed)]
        boundary = self.engine.is_gradient_accumulation_boundary()
        rows, tokens, out = len(idx), max(1, data.mask_sum(idx)), {}
        for j, piece in enumerate(pieces):
            self.engine.set_gradient_accumulation_boundary(boundary and j == len(pieces) - 1)
            share_tokens = data.mask_sum(piece) / tokens
            loss_share = self.loss_kind.piece_share(len(piece) / rows, share_tokens)
            longest = max(len(data.prompt_ids[i]) + len(data.completion_ids[i]) for i in piece)
            with piece_attention(self.engine.device, cfg.train.cpu_attention, longest):  # a checkpointed layer's recompute too
                metrics = self._piece_step(data, piece, mb_tokens, weight * loss_share)
            for key, v in metrics.items():
                combine(out, key, v, loss_share if key.startswith("loss/") else share_tokens)
        return out

    def _piece_step(self, data: "UpdateData", idx: np.ndarray, mb_tokens: int, weight: float) -> dict:
        cfg = self.cfg
        dev = self.engine.device
        batch, old, ref, adv, sampler = data.batch(idx, share_prompts=self.share_prompts, packed=self.packed)
        batch, adv = batch.to(dev), adv.to(dev)
        ref = ref.to(dev) if ref is not None else None
        sampler = sampler.to(dev) if sampler is not None else None
        logp, entropy = token_logprobs(self.engine.module, batch, cfg.rollout.temperature, with_entropy=True, precision=self.precision)
        if old is None:  # first epoch of one step per epoch: the policy is still the old one (ratio 1, as TRL does)
            old = logp.detach()
            data.record_old(idx, old)
        old = old.to(dev)
        if cfg.loss.entropy_coef == 0:
            entropy = entropy.detach()
        loss, metrics = grpo.policy_loss(
            logp, old, adv, batch.loss_mask, cfg.loss,  # the tokens the model sampled: not an episode's tool results
            ref_logprobs=ref if cfg.loss.kl_coef > 0 else None,
            max_completion_length=cfg.rollout.completion_budget(),  # Dr. GRPO's normaliser
            num_items=mb_tokens / self.world,  # DeepSpeed averages gradients over ranks
            entropy=entropy,
            sampler_logprobs=sampler,  # w = exp(old - sampler), old being this forward detached where it stood in above
        )
        if cfg.loss.kl_coef == 0 and ref is not None:
            with torch.no_grad():
                metrics["kl/mean"] = float(_masked_mean(grpo.kl_estimate(logp, ref, cfg.loss.kl_estimator), batch.loss_mask))
        self.engine.backward(loss * weight, scale_wrt_gas=False)
        return metrics


def _masked_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return (x * m).sum() / m.sum().clamp(min=1)
