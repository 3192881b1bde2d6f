"""Cases that need a real engine, slow: grpo's own `Trainer` on DeepSpeed (gloo, CPU), and a vLLM sampler
that must sample from the weights an update made.

The experiment runs on one iteration's real training rows (`UpdateData`: a tiny model's rollout, score
and logprobs). The test suite hands it the rows tests/test_uneven_batches.py already made (`use`), so no
second rollout runs; `grpo conformance` makes its own with `make_rows`.

The implementation asked is a `Stepper`: `delta(stage, grad_accum, rows)` -> the flattened change of
the weights after one optimizer step over `rows`, from a fresh `Trainer` with `train.zero_stage` and
`train.grad_accum` set. grpo's sets DeepSpeed's accumulation boundary on the last micro-batch of the
mini-batch only (`Trainer.accumulate`); the broken one marks every micro-step a boundary, as a trainer
calling backward() several times per step with DeepSpeed's `gradient_accumulation_steps: 1` does.

The sampler case runs on a started vLLM engine and two policy directories that differ (`use_sampler`; the
test suite hands it tests/test_engines.py's sleeping engine, `grpo conformance` starts one with
`make_sampler`). The implementation asked is a `Syncer`: `sync(engine, policy_dir)` hands the asleep
engine the update's weights (grpo's: `VLLMEngine.load`, what pipeline.rollout.policy_engine calls); the broken
one skips it, so the wake restores the weights the engine slept with (TRL #5312).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from pipeline.conformance.case import Case

_ROWS: dict[str, Any] = {}


def use(run, data, rows) -> None:
    """The iteration's rows (a Run, its UpdateData with advantages set, the row indices of one mini-batch)."""
    _ROWS.clear()
    _ROWS.update(run=run, data=data, rows=rows)


def make_rows(model: str, data_path: str, workdir: str, system_prompt: str | None = None) -> None:
    """One iteration of 2 prompts x 4 completions (HF engine) on `model`, with seeded advantages."""
    import torch

    from pipeline import config as config_mod
    from pipeline.logprobs import run_logprobs
    from pipeline.rollout import run_rollout
    from pipeline.run.run import Run, init_run
    from pipeline.score import run_score
    from pipeline.update.data import UpdateData

    cfg = config_mod.resolve({
        "model": model, "data": {"train": data_path, "system_prompt": system_prompt},
        "rollout": {"engine": "hf", "num_generations": 4, "prompts_per_iter": 2, "groups_per_part": 2, "max_new_tokens": 24},
        "rewards": [{"fn": "correct"}, {"fn": "format", "weight": 0.5}],
        "train": {"mini_batch_size": 8, "lr": 1e-4, "precision": "fp32"}, "tracking": {"mlflow": False}, "seed": 0})
    init_run(workdir, cfg)
    run = Run(workdir)
    run_rollout(run, 0)
    run_score(run, 0)
    run_logprobs(run, 0)
    data = UpdateData(run, 0)
    data.adv = torch.randn(data.size, generator=torch.Generator().manual_seed(3))  # every row carries a gradient
    use(run, data, list(range(data.size)))


@dataclass(frozen=True)
class Stepper:
    delta: Callable[[int, int], Any]


def _delta(stage: int, grad_accum: int, every_boundary: bool):
    import numpy as np
    import torch

    from pipeline.update.trainer import Trainer

    if not _ROWS:
        raise RuntimeError("no training rows: pipeline.conformance.engine.use or make_rows first")
    run, data, rows = _ROWS["run"], _ROWS["data"], np.asarray(_ROWS["rows"])
    train = run.cfg.train.model_copy(update={"zero_stage": stage, "grad_accum": grad_accum, "mini_batch_size": max(len(rows), 2)})
    trainer = Trainer(run.cfg.model_copy(update={"train": train}), run.policy_dir(0), None, base_dir=run.policy_dir(0))
    try:
        before = [p.detach().clone() for p in trainer.engine.module.parameters()]
        if every_boundary:
            mark = trainer.engine.set_gradient_accumulation_boundary
            trainer.engine.set_gradient_accumulation_boundary = lambda boundary: mark(True)
        trainer.engine.train()
        trainer.accumulate(data, rows)
        trainer.engine.step()
        return torch.cat([(p.detach() - b).flatten() for p, b in zip(trainer.engine.module.parameters(), before)])
    finally:
        trainer.close()


def _reference():
    """delta(ZeRO 0, one micro-batch), made once: with a single backward per step there is one boundary
    whatever marks it, so grpo's and the broken variant's reference are the same run."""
    if "reference" not in _ROWS:
        _ROWS["reference"] = _delta(0, 1, every_boundary=False)
    return _ROWS["reference"]


def grpo_stepper() -> Stepper:
    return Stepper(lambda stage, ga: _reference() if (stage, ga) == (0, 1) else _delta(stage, ga, every_boundary=False))


def boundary_every_step_stepper() -> Stepper:
    """DeepSpeed #7981 / open-instruct #1498: every backward() a boundary, so ZeRO-1/2 keeps the last only."""
    return Stepper(lambda stage, ga: _reference() if (stage, ga) == (0, 1) else _delta(stage, ga, every_boundary=True))


def zero_accumulation_experiment(s: Stepper) -> tuple[bool, str]:
    """One optimizer step over a mini-batch cut into 2 micro-batches under ZeRO-2 must move the weights as
    the same mini-batch in one micro-batch without ZeRO does: delta(ZeRO-2, grad_accum 2) = delta(ZeRO-0, 1).
    Adam's first step is about lr * sign(g) elementwise, so a dropped micro-step flips the sign of many
    elements (measured: 0.86 relative); fp32 rounding of the split leaves 6e-5."""
    ref = s.delta(0, 1)
    got = s.delta(2, 2)
    err = float((got - ref).norm() / ref.norm())
    return bool(float(ref.norm()) > 0 and err < 1e-3), f"|delta(ZeRO-2, 2 micro) - delta(one micro)| / |delta| = {err:.2e}"


_SAMPLER: dict[str, Any] = {}
PROBE = list(range(3, 40))  # token ids whose teacher-forced logprobs tell two policies apart


def use_sampler(engine, old, new) -> None:
    """A started vLLM engine (any weights) and the directories of two policies (before, after an update)."""
    _SAMPLER.clear()
    _SAMPLER.update(engine=engine, old=old, new=new)


def make_sampler(model: str, workdir: str):
    """For `grpo conformance`: `model` and a perturbed copy (as one update step moves it), and a vLLM
    engine on the first; returns the engine (the caller closes it)."""
    import shutil
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.config.rollout import RolloutConfig
    from pipeline.models.vllm_engine import VLLMEngine

    old, new = Path(workdir) / "old", Path(workdir) / "new"
    shutil.copytree(model, old, dirs_exist_ok=True)
    shutil.copytree(model, new, dirs_exist_ok=True)
    m = AutoModelForCausalLM.from_pretrained(old, dtype=torch.float32)
    with torch.no_grad():
        emb = m.get_input_embeddings().weight
        emb.add_(0.05 * torch.randn(emb.shape, generator=torch.Generator().manual_seed(0)))
    m.save_pretrained(new)
    engine = VLLMEngine(old, RolloutConfig(max_new_tokens=12), 256, seed=0)
    use_sampler(engine, old, new)
    return engine


@dataclass(frozen=True)
class Syncer:
    sync: Callable  # (engine, policy_dir) -> None


def grpo_syncer() -> Syncer:
    return Syncer(lambda engine, policy: engine.load(policy))


def unsynced_syncer() -> Syncer:
    """TRL #5312: with vllm_enable_sleep_mode the wake restored the slept weights; the update's never arrived."""
    return Syncer(lambda engine, policy: None)


def _trainer_probe(policy):
    """The policy's own logprobs of PROBE, from its stored files in fp32 (transformers, CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    key = f"probe:{policy}"
    if key not in _SAMPLER:
        model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.tensor([PROBE])).logits[0, :-1].float(), -1)
        _SAMPLER[key] = lp.gather(-1, torch.tensor(PROBE[1:])[:, None])[:, 0]
    return _SAMPLER[key]


def new_weights_experiment(s: Syncer) -> tuple[bool, str]:
    """The engine samples the old policy, sleeps while the update trains, is handed the new policy, wakes:
    its logprobs must be the new policy's, mean |engine - new| < 1e-4 (fp32 on both sides: measured ~1e-7),
    while the two policies are > 1e-2 apart (so the old weights cannot pass)."""
    import torch

    if not _SAMPLER:
        raise RuntimeError("no sampler: pipeline.conformance.engine.use_sampler or make_sampler first")
    engine, old, new = _SAMPLER["engine"], _SAMPLER["old"], _SAMPLER["new"]
    engine.load(old)
    engine.generate([PROBE[:6]], [1], n=1)  # the rollout, on the old policy
    engine.sleep()  # the update trains
    s.sync(engine, new)
    got = torch.tensor(engine.probe(PROBE))  # wakes it
    ref, before = _trainer_probe(new), _trainer_probe(old)
    gap, apart = float((got - ref).abs().mean()), float((before - ref).abs().mean())
    return gap < 1e-4 and apart > 1e-2, f"mean |engine - new policy| = {gap:.2e} nats (old vs new: {apart:.2e})"


def cases() -> list[Case]:
    return [
        Case("zero-keeps-every-micro-step", "ZeRO-1/2 steps on the sum of every micro-step's gradient",
             "DeepSpeed #7981, open-instruct #1498", "delta(ZeRO-2, [micro 1, micro 2]) = delta(one micro-batch) (rel. < 1e-3)",
             zero_accumulation_experiment, grpo_stepper, boundary_every_step_stepper, slow=True,
             trl_na="not applicable: TRL accumulates through accelerate / transformers' Trainer, not manual boundaries"),
        Case("sampler-gets-new-weights", "a sleeping sampler wakes with the weights the update made",
             "TRL #5312, fixed by #5313", "mean |logp_engine - logp_new policy| < 1e-4 after sleep, sync, wake (policies 1e-2 apart)",
             new_weights_experiment, grpo_syncer, unsynced_syncer, slow=True,
             trl_na="not measured: TRL's sleep mode is vLLM colocate on a GPU (vllm_enable_sleep_mode); not run on this CPU"),
    ]
