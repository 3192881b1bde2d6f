"""The GPU path's decisions, taken from device facts passed in: CUDA graphs or eager, vLLM's
sleep level, bf16, NCCL or gloo, the memory estimates and the split of one GPU between vLLM and
the trainer, and the one-line errors of a split that cannot fit. No GPU is needed: each
decision is a function of a `Device`; the CPU's decisions are the path the suite runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline import config as config_mod
from pipeline.config.train import LoraSpec
from pipeline.errors import GRPOError
from pipeline.models import device_budget as dp
from pipeline.models.device_budget import Device, ModelShape
from pipeline.run.policy import policy_kind

GiB = 1 << 30
CPU = Device("cpu")
CPU_BF16 = Device("cpu", 0, True)
H100 = Device("cuda", 80 * GiB, True)
GPU24 = Device("cuda", 24 * GiB, True)
OLD_GPU = Device("cuda", 16 * GiB, False)  # no bf16 (a V100)

SMOLLM2 = {  # SmolLM2-135M-Instruct's config.json, the fields the estimates read
    "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True, "max_position_embeddings": 8192,
}
QWEN_7B = {  # Qwen2.5-7B's shape
    "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
    "intermediate_size": 18944, "vocab_size": 152064, "tie_word_embeddings": False, "max_position_embeddings": 32768,
}


def make_cfg(**sections) -> config_mod.Config:
    tree = {"model": "m", "data": {"train": "t.jsonl"}, "rewards": [{"fn": "format"}], **sections}
    return config_mod.resolve(tree)


def model_dir(tmp_path: Path, conf: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(conf))
    return tmp_path


def test_cuda_graphs_unless_enforce_eager_and_always_eager_on_a_cpu():
    for option in (None, True, False):
        assert dp.enforce_eager(CPU, option) is True  # the CPU path as it always was
    assert dp.enforce_eager(H100, None) is False  # CUDA graphs by default
    assert dp.enforce_eager(H100, True) is True
    assert dp.enforce_eager(H100, False) is False


def test_sleep_mode_level_2_for_full_weights_1_for_served_adapters_none_on_a_cpu():
    assert dp.sleep_level(H100, "merged") == 2  # weights and KV cache discarded: the next policy replaces them
    assert dp.sleep_level(H100, "vllm_lora") == 1  # the base is offloaded and comes back: no iteration reloads it
    assert dp.sleep_level(CPU, "merged") is None and dp.sleep_level(CPU, "vllm_lora") is None


def test_bf16_by_default_where_the_device_computes_in_it():
    assert dp.resolve_precision("auto", H100) == "bf16" and dp.engine_dtype("auto", "auto", H100) == "bfloat16"
    assert dp.resolve_precision("auto", OLD_GPU) == "fp32" and dp.engine_dtype("auto", "auto", OLD_GPU) == "float32"
    assert dp.resolve_precision("auto", CPU) == "fp32" and dp.resolve_precision("auto", CPU_BF16) == "bf16"
    # explicit settings are kept, and rollout.dtype overrides what auto would follow
    assert dp.resolve_precision("fp32", H100) == "fp32" and dp.engine_dtype("auto", "fp32", H100) == "float32"
    assert dp.engine_dtype("float16", "auto", H100) == "float16" and dp.engine_dtype("bfloat16", "fp32", CPU) == "bfloat16"


def test_tokens_resolve_precision_takes_the_device():
    from pipeline.models.tokens import resolve_precision

    assert resolve_precision("auto", H100) == "bf16" and resolve_precision("auto", OLD_GPU) == "fp32"
    assert resolve_precision("auto") == dp.resolve_precision("auto", dp.this_device())


def test_deepspeed_over_nccl_on_gpus_and_gloo_on_cpus():
    assert dp.dist_backend(H100) == "nccl" and dp.dist_backend(CPU) == "gloo"


def test_this_machine_is_a_cpu_here():
    """The suite runs on CPU machines: the path it exercises end to end is the CPU one."""
    import torch

    assert dp.this_device().cuda == torch.cuda.is_available()


def test_parameter_count_from_config_equals_the_weights_of_smollm2(smollm2):
    """134,515,008 parameters: embedding 49152 x 576 = 28,311,552 (tied head) + 30 layers x
    (q, o: 2 x 576 x 576 = 663,552; k, v: 2 x 576 x 192 = 221,184; MLP 3 x 576 x 1536 = 2,654,208;
    norms 1,152) = 30 x 3,540,096 = 106,202,880 + final norm 576; counted here from the
    safetensors headers of the converted model."""
    import math

    from safetensors import safe_open

    shape = ModelShape.from_dir(Path(smollm2["dir"]))
    stored = 0
    for f in Path(smollm2["dir"]).glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            stored += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    assert shape.params == stored == 134_515_008
    assert shape.kv_bytes_per_token("bfloat16") == 2 * 30 * 3 * 64 * 2 == 23_040
    assert shape.kv_bytes_per_token("float32") == 46_080


def test_trainer_estimates_full_bf16_and_lora():
    shape = ModelShape.from_config(SMOLLM2)
    P = 134_515_008
    # full fp32, one step per iteration, no KL: 4 + 4 + 8 = 16 bytes a parameter, no logprob model kept
    a = make_cfg(rollout={"prompts_per_iter": 4, "num_generations": 4}, train={"mini_batch_size": 16})
    resident, peak = dp.trainer_bytes(shape, policy_kind(a), H100)
    assert resident == 16 * P == 2_152_240_128
    # activations 90 x 576 x 30 x 1024 tokens = 1,592,524,800 + fixed 320 MiB = 335,544,320 (the two-term fit,
    # bench/long.py --one fit); head 2 x 4 x 1024 x 49152 = 402,653,184
    assert peak == 2_152_240_128 + 1_592_524_800 + 335_544_320 + 402_653_184
    b = a.model_copy(update={"train": a.train.model_copy(update={"gradient_checkpointing": True})})
    # a tenth of the per-token activations, 159,252,480; the fixed part stays
    assert dp.trainer_bytes(shape, policy_kind(b), H100)[1] == 2_152_240_128 + 159_252_480 + 335_544_320 + 402_653_184
    # train.bf16 (2 + 2 + 4 master + 4 accumulator + 8 moments = 20) with KL and a logprobs pass: ref and old kept, 4 + 4
    c = make_cfg(train={"bf16": True, "mini_batch_size": 8}, loss={"kl_coef": 0.05})
    assert dp.trainer_bytes(shape, policy_kind(c), H100)[0] == 28 * P == 3_766_420_224
    # ZeRO-3 over 4 ranks splits weights, gradients and optimizer: 20P / 4, kept models unsplit
    z = make_cfg(train={"bf16": True, "mini_batch_size": 8, "zero_stage": 3}, loss={"kl_coef": 0.05})
    assert dp.trainer_bytes(shape, policy_kind(z), H100, world=4)[0] == 5 * P + 8 * P
    # LoRA r16 under bf16: embedding fp32 4 x 28,311,552 + linears bf16 2 x 106,203,456 = 325,653,120;
    # adapter 16 x 30 x (2 x (576+576) + 2 x (576+192) + 3 x (576+1536)) = 4,884,480 params x 16 = 78,151,680;
    # with KL one fp32 base kept for old and ref: 4P = 538,060,032
    d = make_cfg(train={"lora": {"r": 16}, "precision": "auto", "mini_batch_size": 8}, loss={"kl_coef": 0.05})
    assert shape.lora_params(16) == 4_884_480
    assert dp.trainer_bytes(shape, policy_kind(d), H100)[0] == 325_653_120 + 78_151_680 + 538_060_032
    assert dp.trainer_bytes(shape, policy_kind(d), OLD_GPU)[0] == 4 * P + 78_151_680 + 538_060_032  # no bf16: the base stays fp32


def test_a_long_completion_is_one_piece_and_a_length_that_cannot_fit_is_refused():
    """A row longer than train.update_token_budget runs as a piece of its own: the estimate's
    activations grow with its tokens, the LM head's logits stay one 1024-token chunk."""
    shape = ModelShape.from_config(SMOLLM2)
    short = make_cfg(rollout={"max_new_tokens": 512})
    assert dp.piece_tokens(short) == 1024  # 256 (prompt allowance) + 512 fits the budget
    resident, peak = dp.trainer_bytes(shape, policy_kind(short), H100)
    # 90 x 576 x 30 x 1024 = 1,592,524,800 + 320 MiB fixed + one head chunk 2 x 4 x 1024 x 49152
    assert peak - resident == 1_592_524_800 + 335_544_320 + 402_653_184
    long = make_cfg(rollout={"max_new_tokens": 16384})
    assert dp.piece_tokens(long) == 256 + 16384
    resident, peak = dp.trainer_bytes(shape, policy_kind(long), H100)
    # linear in tokens: 90 x 576 x 30 x 16640 = 25,878,528,000; the fixed part and the head chunk do not grow
    assert peak - resident == 25_878_528_000 + 335_544_320 + 402_653_184
    dp.check_trainer(peak, H100)  # 16k tokens of SmolLM2 fit 80 GiB
    longer = make_cfg(rollout={"max_new_tokens": 65536})
    with pytest.raises(GRPOError, match=r"^GPU \(80.0 GiB\): the trainer needs ~\d+.\d GiB .*rollout.max_new_tokens") as err:
        dp.check_trainer(dp.trainer_bytes(shape, policy_kind(longer), H100)[1], H100)
    assert "\n" not in str(err.value)
    pinned = make_cfg(rollout={"max_new_tokens": 65536, "max_model_len": 2048})  # the engine cuts rows at 2048 tokens
    assert dp.piece_tokens(pinned) == 2048


def test_engine_minimum_is_weights_one_sequence_of_kv_and_the_overhead():
    shape = ModelShape.from_config(SMOLLM2)
    # 2 x 134,515,008 + 23,040 x 2048 + 1 GiB
    assert dp.engine_min_bytes(shape, "bfloat16", 2048) == 269_030_016 + 47_185_920 + GiB
    assert dp.engine_min_bytes(shape, "bfloat16", 2048, tensor_parallel=2) == 134_515_008 + 23_592_960 + GiB


def test_gpu_memory_utilization_is_derived_to_leave_the_trainer_room(tmp_path):
    m = model_dir(tmp_path, SMOLLM2)
    cfg = make_cfg(train={"bf16": True, "mini_batch_size": 8}, loss={"kl_coef": 0.05})
    plan = dp.engine_settings_for(cfg.rollout, m, 2048, cfg.train.precision, GPU24, shared_with=policy_kind(cfg))
    # (24 GiB - 3,766,420,224 trainer - 1,288,490,188 margin (24 GiB / 20)) / 24 GiB = 0.80384...
    assert plan.gpu_memory_utilization == round((24 * GiB - 3_766_420_224 - 1_288_490_188) / (24 * GiB), 4) == 0.8038
    assert plan.enforce_eager is False and plan.sleep_level == 2 and plan.dtype == "bfloat16"
    assert plan.kv_cache_bytes is None  # on a GPU vLLM sizes the KV cache from the fraction
    alone = dp.engine_settings_for(cfg.rollout, m, 2048, cfg.train.precision, GPU24)
    assert alone.gpu_memory_utilization == 0.9  # vLLM's default, for a rollout command alone
    small = dp.engine_settings_for(cfg.rollout, m, 2048, cfg.train.precision, H100, shared_with=policy_kind(cfg))
    assert small.gpu_memory_utilization == 0.9  # never more than vLLM's own default
    given = make_cfg(rollout={"gpu_memory_utilization": 0.5, "kv_cache_gib": 2.0, "enforce_eager": True})
    plan = dp.engine_settings_for(given.rollout, m, 2048, "auto", GPU24, shared_with=policy_kind(given))
    assert (plan.gpu_memory_utilization, plan.kv_cache_bytes, plan.enforce_eager) == (0.5, 2 * GiB, True)


def test_a_7b_model_shares_an_h100_only_with_lora(tmp_path):
    m = model_dir(tmp_path, QWEN_7B)
    shape = ModelShape.from_dir(m)
    # 28 x (2 x 3584^2 + 2 x 3584 x 512 + 3 x 3584 x 18944 + 2 x 3584) = 28 x 233,053,184 = 6,525,489,152,
    # untied embedding and head 2 x 152064 x 3584 = 1,089,994,752, final norm 3584: Qwen2.5-7B's
    # 7,615,616,512 less its q/k/v biases, 28 x (3584 + 512 + 512) = 129,024
    assert shape.params == 7_615_487_488 == 7_615_616_512 - 129_024
    full = make_cfg(train={"mini_batch_size": 8})
    with pytest.raises(GRPOError) as err:
        dp.engine_settings_for(full.rollout, m, 4096, "auto", H100, shared_with=policy_kind(full))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("GPU (80.0 GiB): the trainer needs ~") and "train.lora" in msg
    with pytest.raises(GRPOError):  # and so it does alone (checked at grpo init)
        dp.check_trainer(dp.trainer_bytes(shape, policy_kind(full), H100)[1], H100)
    lora = make_cfg(train={"lora": {"r": 16}, "mini_batch_size": 8}, loss={"kl_coef": 0.05})
    resident = dp.trainer_bytes(shape, policy_kind(lora), H100)[0]
    plan = dp.engine_settings_for(lora.rollout, m, 4096, "auto", H100, shared_with=policy_kind(lora))
    assert 0.35 < plan.gpu_memory_utilization == round((80 * GiB - resident - 4 * GiB) / (80 * GiB), 4) < 0.45
    assert plan.gpu_memory_utilization * 80 * GiB > dp.engine_min_bytes(shape, "bfloat16", 4096)


def test_a_split_that_cannot_fit_is_one_line_naming_the_option(tmp_path):
    m = model_dir(tmp_path, QWEN_7B)
    lora = make_cfg(train={"lora": {"r": 16}, "mini_batch_size": 8}, loss={"kl_coef": 0.05})
    cases = {
        # the fraction given leaves the trainer (~47 GiB) too little
        0.9: r"rollout.gpu_memory_utilization 0.9 leaves 8.0 GiB of the 80.0 GiB GPU, and the trainer needs ~4\d.\d GiB",
        # the fraction given is below vLLM's minimum (~16.5 GiB for the bf16 weights and one sequence)
        0.1: r"rollout.gpu_memory_utilization 0.1 gives vLLM 8.0 GiB of the 80.0 GiB GPU, less than the 1\d.\d GiB it needs",
    }
    for util, pattern in cases.items():
        cfg = lora.model_copy(update={"rollout": lora.rollout.model_copy(update={"gpu_memory_utilization": util})})
        with pytest.raises(GRPOError, match=pattern) as err:
            dp.engine_settings_for(cfg.rollout, m, 4096, "auto", H100, shared_with=policy_kind(cfg))
        assert "\n" not in str(err.value)
    # derived, on a 60 GiB GPU: the trainer's peak (~53.8 GiB) fits, but its ~44.2 GiB resident
    # and the 3 GiB margin leave vLLM ~12.8 GiB, less than its ~15.4 GiB minimum
    gpu60 = Device("cuda", 60 * GiB, True)
    with pytest.raises(GRPOError, match=r"^GPU \(60.0 GiB\): the trainer needs ~44.2 GiB beside the engine .* they cannot share it"):
        dp.engine_settings_for(lora.rollout, m, 4096, "auto", gpu60, shared_with=policy_kind(lora))
    dp.engine_settings_for(lora.rollout, m, 4096, "auto", gpu60)  # each alone fits: separate commands run
    dp.check_trainer(dp.trainer_bytes(ModelShape.from_dir(m), policy_kind(lora), gpu60)[1], gpu60)


def test_the_cpu_plan_is_what_the_cpu_path_always_passed(tmp_path):
    from pipeline.models.engine_memory import kv_cache_bytes

    m = model_dir(tmp_path, SMOLLM2)
    cfg = make_cfg(train={"mini_batch_size": 8, "precision": "fp32"})
    for shared in (None, policy_kind(cfg)):
        plan = dp.engine_settings_for(cfg.rollout, m, 2048, "fp32", CPU, shared_with=shared)
        assert plan == dp.EngineSettings(True, None, 0.5, kv_cache_bytes(cfg.rollout, m, 2048, "float32"), "float32")
    # a CPU never refuses: it cannot know a GPU, and nothing here needs one
    tiny = dp.engine_settings_for(cfg.rollout, model_dir(tmp_path, QWEN_7B), 4096, "fp32", CPU, shared_with=policy_kind(cfg))
    assert tiny.sleep_level is None and tiny.enforce_eager


def test_init_checks_the_gpu_on_a_gpu_machine_and_nothing_on_a_cpu(tmp_path):
    from pipeline.preflight import check_device

    m = model_dir(tmp_path, QWEN_7B)
    full = make_cfg(model=str(m), train={"mini_batch_size": 8})
    check_device(full, CPU)  # a CPU machine cannot know the GPU
    check_device(full.model_copy(update={"train": full.train.model_copy(update={"lora": LoraSpec()})}), H100)
    with pytest.raises(GRPOError, match=r"^GPU \(80.0 GiB\): the trainer needs ~1\d\d.\d GiB at its peak"):
        check_device(full, H100)  # a full fine-tuning of 7 B (16 bytes a parameter) fits no H100
    given = make_cfg(model=str(m), rollout={"gpu_memory_utilization": 0.1}, train={"lora": {"r": 8}})
    with pytest.raises(GRPOError, match=r"^rollout.gpu_memory_utilization 0.1 gives vLLM"):
        check_device(given, H100)


def test_grpo_init_refuses_a_gpu_split_before_writing_anything(assets, tmp_path, monkeypatch):
    """`grpo init` on a (described) GPU the engine cannot fit on: one line, no run directory."""
    from conftest import base_config
    from stages.init import init

    monkeypatch.setattr(dp, "may_have_gpu", lambda: True)  # an NVIDIA driver is loaded
    monkeypatch.setattr(dp, "this_device", lambda: Device("cuda", GiB, True))  # 1 GiB: less than vLLM's overhead
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(base_config(assets)))
    with pytest.raises(GRPOError, match=r"^rollout.gpu_memory_utilization 0.9 gives vLLM 0.9 GiB of the 1.0 GiB GPU"):
        init(str(tmp_path / "run"), str(cfg))
    assert not (tmp_path / "run").exists()


def test_new_options_keep_the_config_hash_of_runs_made_before_them():
    cfg = make_cfg()
    tree = json.loads(config_mod.canonical(cfg))
    assert "enforce_eager" not in tree["rollout"] and "weight_sync" not in tree["rollout"]
    changed = make_cfg(rollout={"weight_sync": "memory"})
    assert config_mod.config_hash(changed) != config_mod.config_hash(cfg)
    # the default auto: memory for full fine-tuning, disk with LoRA; the same bytes, so disk's hash
    disk = make_cfg(rollout={"weight_sync": "disk"})
    assert (cfg.rollout.weight_sync, cfg.weight_sync, disk.weight_sync) == ("auto", "memory", "disk")
    assert config_mod.config_hash(disk) == config_mod.config_hash(cfg)
    assert make_cfg(train={"lora": {"r": 8}}).weight_sync == "disk"
    with pytest.raises(GRPOError, match="rollout.weight_sync memory hands over full weights"):
        make_cfg(rollout={"weight_sync": "memory"}, train={"lora": {"r": 8}})


def test_the_gpu_proofs_estimates_are_within_1_3x_of_its_measured_peaks_and_not_below():
    """bench/gpu's real size (Qwen2.5-0.5B's shape, bf16, ZeRO-2, 16 prompts x G 8 x 256 tokens,
    mini-batch 32, budget 16384, KL) measured 22.1 GiB (full) and 14.5 GiB (LoRA) peak allocated on
    an H200 (docs/gpu.md, 2026-11-27). A piece holds at most its micro-batch: ceil(32 / 8) = 4 shared
    prompts x 256 (allowance) + 32 x 256 completion tokens = 9216, not the budget's 16384."""
    qwen = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
            "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True}
    shape = ModelShape.from_config(qwen)
    assert shape.params == 494_005_120
    h200 = Device("cuda", 139 * GiB, True)
    # full: the bf16 module keeps 45 x 896 bytes a token and layer: 45 x 896 x 24 x 9216 = 8,918,138,880;
    # LoRA: 45 x 896 + the adapter's bf16 input casts 2 x (6 x 896 + 4864) = 60,800 x 24 x 9216 = 13,447,987,200
    for lora, measured, act in ((None, 22.1, 8_918_138_880), ({"r": 16, "alpha": 32}, 14.5, 13_447_987_200)):
        train = {"mini_batch_size": 32, "zero_stage": 2, "bf16": True, "update_token_budget": 16384}
        if lora:
            train["lora"] = lora
        cfg = make_cfg(rollout={"prompts_per_iter": 16, "num_generations": 8, "max_new_tokens": 256}, train=train,
                       loss={"kl_coef": 0.04})
        assert dp.piece_tokens(cfg) == 9216
        resident, peak = dp.trainer_bytes(shape, policy_kind(cfg), h200)
        # + fixed 320 MiB = 335,544,320 + one head chunk 2 x 4 x 1024 x 151936 = 1,244,659,712
        assert peak - resident == act + 335_544_320 + 1_244_659_712
        assert measured <= peak / GiB <= 1.3 * measured  # were 2.0 (full) and 2.4 (LoRA) x with the whole budget at fp32 width


def test_the_cpu_estimate_of_one_rows_backward_is_within_1_3x_of_bench_longs_measured_peaks():
    """bench/long.json's `fit` (`python -m bench.long --one fit N`: SmolLM2-135M, fp32, one packed row
    of N tokens forward and backward, peak RSS above the loaded model, gradients included) against
    the estimate for the same piece: gradients + activations + fixed + one head chunk."""
    fit = json.loads((Path(__file__).parents[1] / "bench" / "long.json").read_text())["fit"]
    shape = ModelShape.from_config(SMOLLM2)
    for n, point in fit.items():
        cfg = make_cfg(rollout={"prompts_per_iter": 1, "num_generations": 2, "max_new_tokens": int(n) - 256},
                       train={"mini_batch_size": 1, "update_token_budget": 256})
        assert dp.piece_tokens(cfg) == int(n)  # one row: 256 allowance + its completion
        resident, peak = dp.trainer_bytes(shape, policy_kind(cfg), CPU)
        estimate = point["grad_mb"] + (peak - resident) / (1 << 20)
        measured = point["backward"]["above_mb"]
        assert measured <= estimate <= 1.3 * measured, (n, estimate, measured)
