"""A short last mini-batch, cut unevenly into micro-batches and pieces, weighs as its loss type says.

20 rows with `mini_batch_size: 12` leave a last mini-batch of 8; `grad_accum: 2` cuts it [6, 2]
(micro-batches of 12 // 2 rows), `grad_accum: 4` [3, 3, 2]. Its accumulated gradient must be the
gradient of the same 8 rows run as one micro-batch, for every loss type whose normaliser belongs to
the mini-batch:

- grpo, reinforce: a mean over the mini-batch's sequences: a micro-batch weighs its share of the rows;
- dr_grpo: the sum over tokens / (the mini-batch's rows x max_completion_length): its share of the rows;
- dapo: the sum over tokens / the mini-batch's tokens (num_items): each micro-batch's loss already
  is its share, and the shares add up.

bnpo is left out by its definition (TRL's): each micro-batch's token mean, the micro-batches
weighing the same, so [6, 2] is not the 8 rows' token mean; a test below pins that weight.
Under the old weight (1 / number of micro-batches) the split gradient was off by 0.80 (grpo),
0.68 (dr_grpo, reinforce), relative.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

EXACT_TYPES = ("grpo", "dr_grpo", "dapo", "reinforce")


@pytest.fixture(scope="module")
def twenty_rows(assets, tmp_path_factory):
    """One iteration of 5 prompts x G=4 = 20 rows sampled, scored and given logprobs (HF engine),
    with seeded advantages (not all-equal rewards' zeros) so every row carries a gradient."""
    from pipeline import config as config_mod
    from pipeline.logprobs import run_logprobs
    from pipeline.rollout import run_rollout
    from pipeline.score import run_score
    from pipeline.run.run import Run, init_run
    from pipeline.update.data import UpdateData
    from tests.conftest import base_config

    cfg = config_mod.resolve(base_config(assets, rollout={"engine": "hf", "prompts_per_iter": 5, "groups_per_part": 5},
                                         train={"mini_batch_size": 12, "grad_accum": 2, "precision": "fp32"}))
    path = tmp_path_factory.mktemp("uneven") / "run"
    init_run(str(path), cfg)
    run = Run(str(path))
    run_rollout(run, 0)
    run_score(run, 0)
    run_logprobs(run, 0)
    data = UpdateData(run, 0)
    assert data.size == 20 and not data.old_from_update
    data.adv = torch.randn(20, generator=torch.Generator().manual_seed(3))
    lengths = data.model_tokens[12:]
    assert lengths.min() > 0 and len(set(lengths.tolist())) > 1  # completions of different lengths
    return run, data


@pytest.fixture(scope="module")
def trainer(twenty_rows):
    from pipeline.update.trainer import Trainer

    run, _ = twenty_rows
    t = Trainer(run.cfg, run.policy_dir(0), None, base_dir=run.policy_dir(0))
    yield t
    t.close()


def _gradient(trainer, data, cfg, loss_type: str, grad_accum: int, budget: int | None = None) -> torch.Tensor:
    """The last mini-batch's (rows 12..19) accumulated gradient, flattened, as `cfg` with these settings splits it."""
    loss = cfg.loss.model_copy(update={"type": loss_type})
    train = cfg.train.model_copy(update={"grad_accum": grad_accum, **({"update_token_budget": budget} if budget else {})})
    trainer.cfg = cfg.model_copy(update={"loss": loss, "train": train})
    module = trainer.engine.module
    module.zero_grad(set_to_none=True)
    trainer.engine.train()
    acc = trainer.accumulate(data, np.arange(12, 20))
    assert np.isfinite(acc["loss/policy"])
    grad = torch.cat([p.grad.flatten() for p in module.parameters() if p.grad is not None]).clone()
    module.zero_grad(set_to_none=True)
    return grad


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).double().norm() / b.double().norm())


@pytest.mark.parametrize("loss_type", EXACT_TYPES)
def test_an_uneven_last_mini_batch_gives_the_unsplit_gradient(twenty_rows, trainer, loss_type):
    run, data = twenty_rows
    cfg = run.cfg
    whole = _gradient(trainer, data, cfg, loss_type, grad_accum=1)  # micro-batches of 12: the 8 rows at once
    assert float(whole.norm()) > 1e-3
    for grad_accum, budget in ((2, None), (4, None), (2, 64)):  # [6, 2], [3, 3, 2], [6, 2] cut into pieces of <= 64 tokens
        split = _gradient(trainer, data, cfg, loss_type, grad_accum, budget)
        # fp32 kernels block rows by batch size, so [6, 2] and [8] round differently: 1.2e-6 relative on an
        # Intel Xeon (MKL, AMX), under 1e-6 on an AMD EPYC; a wrong weight is off by 0.68 or more
        assert _relative(split, whole) < 1e-5, (loss_type, grad_accum, budget, _relative(split, whole))


def test_bnpo_weighs_each_micro_batch_the_same(twenty_rows, trainer):
    """bnpo, as TRL defines it: the token mean of each micro-batch, micro-batches averaged. The
    [6, 2] gradient is the mean of the two micro-batches' gradients, each run alone."""
    run, data = twenty_rows
    cfg = run.cfg
    split = _gradient(trainer, data, cfg, "bnpo", grad_accum=2)
    whole = _gradient(trainer, data, cfg, "bnpo", grad_accum=1)
    parts = []
    for rows in (np.arange(12, 18), np.arange(18, 20)):
        trainer.engine.module.zero_grad(set_to_none=True)
        trainer.cfg = cfg.model_copy(update={"loss": cfg.loss.model_copy(update={"type": "bnpo"}),
                                             "train": cfg.train.model_copy(update={"grad_accum": 1})})
        trainer.accumulate(data, rows)
        parts.append(torch.cat([p.grad.flatten() for p in trainer.engine.module.parameters() if p.grad is not None]).clone())
    trainer.engine.module.zero_grad(set_to_none=True)
    assert _relative(split, (parts[0] + parts[1]) / 2) < 1e-6
    assert _relative(split, whole) > 1e-3  # by its definition, not the 8 rows' token mean


def test_the_update_computes_on_one_thread_without_omp_num_threads(twenty_rows, trainer, monkeypatch):
    """Without OMP_NUM_THREADS, every forward and backward of `train_iteration` runs on one thread
    (pipeline/update/threads.py; on torch's thread per core a busy core stalled the demo's update
    several fold), and the process's setting is back afterwards. Before the conformance test below: it
    steps the shared trainer."""
    run, data = twenty_rows
    trainer.cfg = run.cfg
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    torch._C.set_num_threads(2)
    seen: list[int] = []
    step = trainer.micro_step

    def counted(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return step(*args, **kwargs)

    monkeypatch.setattr(trainer, "micro_step", counted)
    try:
        rows = trainer.train_iteration(data, 0)
        assert len(rows) == 2 and set(seen) == {1}, seen  # 20 rows, mini-batches of 12: 2 steps
        assert torch.get_num_threads() == 2
    finally:
        torch._C.set_num_threads(before)


@pytest.mark.slow
def test_conformance_zero_stage_2_steps_on_every_micro_batch(twenty_rows):
    """The conformance case zero-keeps-every-micro-step (DeepSpeed #7981) on this module's rows, so the suite
    makes no second rollout: the short last mini-batch (rows 12..19) in 2 micro-batches under ZeRO-2 moves the
    weights as one micro-batch does, and the broken variant (every micro-step a boundary) is flagged. Last in
    this module: its trainers close the process group the shared trainer trains in."""
    from pipeline.conformance import engine
    from pipeline.conformance.case import run_case

    run, data = twenty_rows
    engine.use(run, data, np.arange(12, 20))
    case = next(c for c in engine.cases() if c.id == "zero-keeps-every-micro-step")
    row = run_case(case, with_trl=False)
    assert row.grpo.holds is True, row.grpo.measured
    assert row.broken.holds is False, row.broken.measured
