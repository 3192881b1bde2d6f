"""The plan `grpo init` prints (pipeline/preview.py): derived quantities against hand-computed values,
where the old logprobs come from in each case the update and the logprobs stage distinguish,
and this machine's precision read without torch agreeing with torch's own answer."""

from __future__ import annotations

import pytest

from pipeline import config as config_mod
from pipeline.schedule import iteration_plan
from pipeline.preview import machine_precision, preview
from pipeline.schedule import steps_per_iter

BASE = {"model": "m", "data": {"train": "t.jsonl"}, "rewards": [{"fn": "correct"}]}


def cfg_of(**sections):
    tree = {**BASE}
    for key, value in sections.items():
        tree[key] = value
    return config_mod.resolve(tree)


def test_the_defaults():
    p = preview(cfg_of(), "fp32")
    assert p.completions == 128  # 16 prompts x 8 generations
    assert p.max_new_tokens == 8192  # 128 completions x 64 tokens
    assert p.steps == 4  # 1 epoch x ceil(128 / 32)
    assert p.total_steps == 400  # 4 steps x 100 iterations (train.total_iters)
    assert p.micro_batch == 32  # 32 / grad_accum 1 / 1 process
    assert (p.precision, p.engine, p.engine_dtype) == ("fp32", "vllm", "float32")
    assert p.old_logprobs == "logprobs stage pass (4 optimizer steps per epoch)" and p.old_logprobs_iter0 is None
    assert p.reference is None and p.training == "full fine-tuning (every weight)"


def test_uneven_mini_batches_accumulation_and_processes():
    cfg = cfg_of(rollout={"prompts_per_iter": 6, "num_generations": 5, "max_new_tokens": 10},
                 train={"epochs": 2, "mini_batch_size": 8, "grad_accum": 4, "total_iters": 7})
    p = preview(cfg, "fp32", world=2)
    assert p.completions == 30  # 6 x 5
    assert p.max_new_tokens == 300  # 30 x 10
    assert p.steps == 8 == steps_per_iter(cfg)  # 2 epochs x ceil(30 / 8) = 2 x 4 (the last mini-batch holds 6)
    assert p.total_steps == 56  # 8 x 7
    assert p.micro_batch == 1  # 8 / 4 / 2
    assert p.old_logprobs == "logprobs stage pass (4 optimizer steps per epoch)"


def test_old_logprobs_from_the_update_and_each_reason_for_a_pass():
    one_step = {"prompts_per_iter": 4, "num_generations": 4}  # 16 completions <= mini_batch_size 32: one step per epoch
    p = preview(cfg_of(rollout=one_step), "fp32")
    assert p.steps == 1 and p.old_logprobs == "the update's own forward (one optimizer step per epoch)"
    assert p.old_logprobs_iter0 is None and p.reference is None
    p = preview(cfg_of(rollout=one_step, train={"old_logprobs": "pass"}), "fp32")
    assert p.old_logprobs == "logprobs stage pass (train.old_logprobs pass)"
    p = preview(cfg_of(rollout=one_step, train={"lora": {"r": 4, "dropout": 0.1}}), "fp32")
    assert p.old_logprobs == "logprobs stage pass (LoRA dropout)"
    assert p.training == "LoRA r=4 alpha=32 on all-linear (policies K >= 1 are adapters)"
    p = preview(cfg_of(rollout=one_step, advantages={"kl_in_reward": {"coef": 0.1}}), "fp32")
    assert p.old_logprobs == "logprobs stage pass (KL in the reward)"
    assert p.reference == "every iteration, on policy/iter-0000 (advantages.kl_in_reward.coef 0.1)"


def test_a_reference_pass_doubles_as_iteration_0s_old_pass():
    """Iteration 0 without ref_model: old policy = reference, one pass gives both (iteration_plan)."""
    cfg = cfg_of(rollout={"prompts_per_iter": 4, "num_generations": 4}, loss={"kl_coef": 0.04})
    zero, one = iteration_plan(cfg, 0), iteration_plan(cfg, 1)
    assert (zero.ref_is_old, zero.old_from_update, zero.old_pass, zero.ref_pass) == (True, False, True, False)
    assert (one.ref_is_old, one.old_from_update, one.old_pass, one.ref_pass) == (False, True, False, True)
    p = preview(cfg, "fp32")
    assert p.old_logprobs == "the update's own forward (one optimizer step per epoch)"
    assert p.old_logprobs_iter0 == "the reference pass (same weights as the old policy)"
    assert p.reference == "every iteration, on policy/iter-0000 (loss.kl_coef 0.04)"
    lora = preview(cfg_of(loss={"kl_coef": 0.04}, train={"lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}}), "fp32")
    assert lora.reference == "every iteration, on the base with the adapter off (loss.kl_coef 0.04)"
    assert lora.training == "LoRA r=8 alpha=16 on q_proj, v_proj (policies K >= 1 are adapters)"
    other = preview(cfg_of(ref_model="ref-dir", loss={"kl_coef": 0.04}), "fp32")
    assert other.reference == "every iteration, on ref-dir (loss.kl_coef 0.04)"
    assert other.old_logprobs_iter0 is None  # a separate reference: iteration 0 is like the others


@pytest.mark.parametrize("dtype, precision, engine", [("auto", "bf16", "bfloat16"), ("auto", "fp32", "float32"),
                                                      ("float16", "bf16", "float16"), ("float32", "bf16", "float32")])
def test_engine_dtype_follows_the_resolved_precision_unless_set(dtype, precision, engine):
    assert preview(cfg_of(rollout={"dtype": dtype}), precision).engine_dtype == engine


def test_machine_precision_agrees_with_torch():
    """The /proc/cpuinfo reading init uses (no torch import) gives what the stages resolve."""
    from pipeline.models.tokens import resolve_precision

    assert machine_precision("auto") == resolve_precision("auto")
    assert machine_precision("fp32") == "fp32" and machine_precision("bf16") == "bf16"


def test_the_printed_lines():
    cfg = cfg_of(rollout={"prompts_per_iter": 6, "num_generations": 4, "max_new_tokens": 48, "engine": "hf"},
                 train={"mini_batch_size": 8, "total_iters": 20, "precision": "auto", "lora": {"r": 8}}, loss={"kl_coef": 0.02})
    assert preview(cfg, "bf16").lines() == [
        "  completions      24 per iteration = 6 prompts x 4 generations (at most 1,152 new tokens)",
        "  optimizer steps  3 per iteration = 1 epoch x ceil(24 / 8); 60 over train.total_iters 20",
        "  micro-batch      8 completions per rank = 8 / grad_accum 1 / 1 process",
        "  precision        bf16 (auto, on this machine); engine hf in bfloat16",
        "  old logprobs     logprobs stage pass (3 optimizer steps per epoch); iteration 0: the reference pass (same weights as the old policy)",
        "  reference pass   every iteration, on the base with the adapter off (loss.kl_coef 0.02)",
        "  training         LoRA r=8 alpha=32 on all-linear (policies K >= 1 are adapters)",
    ]


def test_the_logprob_pass_loads_what_the_plan_says(assets, tmp_path):
    """`LogprobModels` (the same object cold in `grpo logprobs` and warm in `iterate`): iteration 0
    of a KL run makes one pass that is both old and reference, with one model loaded; iteration 1
    (one optimizer step: the update gives the old logprobs) keeps only the reference, policy 0,
    and gives the old model's memory back; a LoRA run's reference is its loaded base, adapter off;
    a run with no pass at all loads nothing."""
    import torch

    from conftest import base_config, grpo, write_config
    from pipeline.run.lora import AdapterOff
    from pipeline.run.policy import LogprobModels, load_model
    from pipeline.run.run import Run

    def run_of(name, **sections):
        cfg = base_config(assets, train={"mini_batch_size": 16, "precision": "fp32", **sections.pop("train", {})}, **sections)
        grpo("init", str(tmp_path / name), "--config", str(write_config(tmp_path / f"{name}.yaml", cfg)))
        return Run(str(tmp_path / name))

    kl = run_of("kl", loss={"kl_coef": 0.04})
    models = LogprobModels(kl)
    old, ref, ref_is_old = models.for_iteration(0)
    assert ref_is_old and old is ref and models.ref is None
    policy0 = load_model(kl.policy_dir(0))
    assert all(torch.equal(a, b) for a, b in zip(old.state_dict().values(), policy0.state_dict().values()))
    old, ref, ref_is_old = models.for_iteration(1)
    assert old is None and not ref_is_old and models.old is None
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), policy0.state_dict().values()))

    lora = LogprobModels(run_of("lora", loss={"kl_coef": 0.04}, train={"lora": {"r": 4}}))
    old, ref, ref_is_old = lora.for_iteration(0)
    assert ref_is_old and old is ref and type(old).__name__ == "PeftModelForCausalLM"
    assert isinstance(lora.policy.ref_of(lora.run, old), AdapterOff)

    none = LogprobModels(run_of("none"))
    assert none.for_iteration(0) == (None, None, False) and none.old is None and none.ref is None
