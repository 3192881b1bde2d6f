"""Real pretrained models: GGUF import and LoRA adapters on SmolLM2-135M-Instruct.

One LoRA run (`lora_run`: `grpo iterate --iters 2`, 2 prompts x G=2 x 16 tokens) is shared by
the LoRA tests; a second one is killed while publishing its last policy and resumed, and must
equal the first byte for byte. A full fine-tuning run starts from the .gguf file itself.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import REPO, base_config, grpo, logprob_rows, write_config
from test_reproduce import record

LORA = {"r": 8, "alpha": 16}


def small(assets: dict, model: str, **sections) -> dict:
    """2 prompts x G=2 x 16 tokens on SmolLM2, KL in the loss (so the reference is computed),
    rewarded by length in characters (16 tokens rarely solve the task; lengths always spread)."""
    sec = {
        "rewards": [{"fn": f"{REPO}/tests/fixtures/rewards/user_rewards.py:record"}],
        "rollout": {"num_generations": 2, "prompts_per_iter": 2, "groups_per_part": 2, "max_new_tokens": 16},
        "train": {"mini_batch_size": 4, "lr": 1e-3},
        "loss": {"kl_coef": 0.05},
        **sections,
    }
    return base_config(assets, model=model, **sec)


def init_fails(tmp_path: Path, cfg: dict) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    run = tmp_path / "run"
    out = grpo("init", str(run), "--config", str(write_config(tmp_path / "config.yaml", cfg)), check=False)
    assert out.returncode != 0
    assert not run.exists(), "a failed init left a run directory"
    lines = [ln for ln in out.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, out.stderr
    return lines[0]


def test_not_a_gguf_and_corrupt_gguf_are_one_line_errors(assets, tmp_path, smollm2):
    fake = tmp_path / "model.gguf"
    fake.write_text("this is not a model\n")
    msg = init_fails(tmp_path / "a", base_config(assets, model=str(fake)))
    assert str(fake) in msg and "not a GGUF file" in msg

    cut = tmp_path / "cut.gguf"  # a real header, then nothing: a truncated download
    with open(smollm2["gguf"], "rb") as src:
        cut.write_bytes(src.read(1 << 16))
    msg = init_fails(tmp_path / "b", base_config(assets, model=str(cut)))
    assert str(cut) in msg and "cannot load this GGUF file" in msg


def test_lora_target_matching_nothing_is_an_init_error(assets, tmp_path):
    cfg = base_config(assets, train={"lora": {"r": 4, "target_modules": ["q_proj", "qkv_projection"]}})
    msg = init_fails(tmp_path, cfg)
    assert "train.lora.target_modules 'qkv_projection'" in msg and "matches no linear module" in msg


def _lora_run(root: Path, assets: dict, smollm2: dict, fault: str | None = None) -> Path:
    run = root / "run"
    cfg = write_config(root / "config.yaml", small(assets, smollm2["dir"], train={"mini_batch_size": 4, "lr": 1e-3, "lora": LORA}))
    grpo("init", str(run), "--config", str(cfg))
    if fault:
        out = grpo("iterate", str(run), "--iters", "2", env={"GRPO_FAULT": fault}, check=False)
        assert out.returncode == -9, out.stderr[-3000:]
    grpo("iterate", str(run), "--iters", "2")
    return run


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, assets, smollm2) -> Path:
    return _lora_run(tmp_path_factory.mktemp("lora"), assets, smollm2)


def _manifest(run: Path, rel: str) -> dict:
    return json.loads((run / rel / "MANIFEST.json").read_text())


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and p.name != "MANIFEST.json")


@pytest.mark.slow
def test_lora_policies_are_small_peft_adapters_on_the_base(lora_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = lora_run / "policy/iter-0000"
    base_hash = _manifest(lora_run, "policy/iter-0000")["policy_hash"]
    for k in (1, 2):
        pol = lora_run / f"policy/iter-{k:04d}"
        assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in pol.iterdir()}
        assert not list(pol.glob("model*.safetensors"))
        assert _bytes(pol) < 0.05 * _bytes(base), (_bytes(pol), _bytes(base))
        m = _manifest(lora_run, f"policy/iter-{k:04d}")
        assert m["adapter"] == {"base": "policy/iter-0000", "base_policy_hash": base_hash}
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(lora_run / "policy/iter-0002"))
    trained = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert trained and any(float(p.abs().max()) > 0 for p in trained)  # the update moved the adapter


@pytest.mark.slow
def test_lora_reference_is_the_base_and_first_step_kl_is_zero(lora_run):
    lp0 = pq.read_table(sorted((lora_run / "iter-0000/logprobs").glob("part-*.parquet"))[0])
    for old, ref in zip(lp0.column("old_logprobs").to_pylist(), lp0.column("ref_logprobs").to_pylist()):
        assert np.array_equal(np.asarray(old), np.asarray(ref))  # zero adapter == adapter off
    m0 = pq.read_table(lora_run / "iter-0000/update/metrics.parquet").to_pylist()
    assert abs(m0[0]["kl/mean"]) < 1e-6
    m1 = pq.read_table(lora_run / "iter-0001/update/metrics.parquet").to_pylist()
    assert m1[0]["kl/mean"] > 1e-6  # after a step the adapter is on and the policy has moved
    lp1 = logprob_rows(lora_run, 1).values()
    assert any(not np.array_equal(np.asarray(r["old_logprobs"]), np.asarray(r["ref_logprobs"])) for r in lp1)


@pytest.mark.slow
def test_lora_vllm_samples_from_the_merged_adapter(lora_run):
    """Iteration 1 was sampled by vLLM from merged policy 1 and scored by the trainer's adapter."""
    roll = pq.read_table(sorted((lora_run / "iter-0001/rollout").glob("part-*.parquet"))[0])
    assert set(roll.column("policy_hash").to_pylist()) == {_manifest(lora_run, "policy/iter-0001")["policy_hash"]}
    lp = logprob_rows(lora_run, 1).values()
    gaps = np.asarray([r["sampler_gap_mean"] for r in lp])
    moved = np.mean([np.abs(np.asarray(r["old_logprobs"]) - np.asarray(r["ref_logprobs"])).mean() for r in lp])
    assert gaps.mean() < 0.02 and gaps.mean() < 0.2 * moved, (gaps, moved)  # vLLM had policy 1, not the base


def test_lora_merge_writes_the_bits_peft_merge_and_unload_writes(lora_run):
    """`merged_model` adds each adapter's delta into new memory instead of PEFT's in-place add:
    the same weights, bit for bit, for a trained adapter (B != 0)."""
    import torch

    from pipeline.run.lora import load_base, merged_model, policy_model

    base, adapter = lora_run / "policy/iter-0000", lora_run / "policy/iter-0002"
    want = policy_model(base, adapter, None, trainable=False).merge_and_unload().state_dict()
    got = merged_model(base, adapter).state_dict()
    plain = load_base(base).state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert any(not torch.equal(got[n], plain[n]) for n in plain)  # the adapter moved some weights


@pytest.mark.slow
def test_lora_run_audits_clean_and_exports_adapter_and_merged_model(lora_run, tmp_path):
    import torch
    from safetensors.torch import load_file

    out = grpo("audit", str(lora_run))
    assert ": ok, 2 iteration(s)" in out.stdout and "lineage intact" in out.stdout, out.stdout

    grpo("export", str(lora_run), str(tmp_path / "adapter"))
    conf = json.loads((tmp_path / "adapter/adapter_config.json").read_text())
    assert conf["base_model_name_or_path"] == str((lora_run / "policy/iter-0000").resolve()) and conf["r"] == LORA["r"]

    grpo("export", str(lora_run), str(tmp_path / "merged"), "--merged")
    merged = load_file(tmp_path / "merged/model.safetensors")
    base = load_file(lora_run / "policy/iter-0000/model.safetensors")
    assert set(merged) == set(base)
    changed = [n for n in base if not torch.equal(base[n], merged[n])]
    assert changed and all("proj" in n for n in changed)
    assert (tmp_path / "merged/tokenizer.json").is_file() and (tmp_path / "merged/config.json").is_file()


@pytest.mark.slow
def test_lora_replay_of_iteration_1_starts_from_the_merged_adapter(lora_run, tmp_path):
    """Replaying a LoRA iteration K >= 1: NEW's policy 0 is SRC's adapter 1 merged into the base,
    recorded as such; the completions are SRC's bytes; its logprobs of them are SRC's (the merged
    weights compute what base + adapter computed); it trains a fresh adapter and audits clean."""
    new = tmp_path / "replay"
    out = grpo("replay", str(lora_run), "--iter", "1", "--to", str(new))
    assert out.stdout.strip().splitlines()[-1].startswith(f"replay of {lora_run} iteration 1 -> {new} iteration 0"), out.stdout
    p0 = _manifest(new, "policy/iter-0000")
    assert p0["merged_from"] == {"run": str(lora_run), "iteration": 1,
                                 "adapter_policy_hash": _manifest(lora_run, "policy/iter-0001")["policy_hash"],
                                 "base_policy_hash": _manifest(lora_run, "policy/iter-0000")["policy_hash"]}
    assert (new / "policy/iter-0000/model.safetensors").is_file()  # full weights, not an adapter
    for part in sorted((lora_run / "iter-0001/rollout").glob("part-*.parquet")):
        assert (new / "iter-0000/rollout" / part.name).read_bytes() == part.read_bytes()
    src_lp, new_lp = logprob_rows(lora_run, 1), logprob_rows(new, 0)
    assert src_lp.keys() == new_lp.keys()
    assert max(float(np.abs(np.asarray(src_lp[key]["old_logprobs"]) - np.asarray(new_lp[key]["old_logprobs"])).max()) for key in src_lp) < 1e-3
    assert _manifest(new, "policy/iter-0001")["adapter"]["base_policy_hash"] == p0["policy_hash"]
    report = grpo("audit", str(new))
    assert ": ok, 1 iteration(s)" in report.stdout and "lineage intact" in report.stdout, report.stdout


@pytest.mark.slow
def test_lora_run_killed_while_publishing_resumes_to_the_same_bytes(lora_run, tmp_path, assets, smollm2):
    again = _lora_run(tmp_path, assets, smollm2, fault="update:publish:1")
    assert record(again) == record(lora_run)


@pytest.mark.slow
def test_full_finetuning_from_a_gguf_file(assets, tmp_path, smollm2):
    """`model:` names the .gguf: init converts it (cached), records the file, and a full
    fine-tuning run of 2 iterations samples readable English."""
    run = tmp_path / "run"
    cfg = small(assets, smollm2["gguf"], train={"mini_batch_size": 4, "lr": 1e-5})
    grpo("init", str(run), "--config", str(write_config(tmp_path / "config.yaml", cfg)))
    m0 = _manifest(run, "policy/iter-0000")
    assert m0["source"] == str(Path(smollm2["gguf"]).resolve())
    assert m0["conversion"]["gguf_sha256"] == smollm2["sha256"] and m0["conversion"]["dtype"] == "float32"
    assert (run / "policy/iter-0000/model.safetensors").is_file()
    grpo("iterate", str(run), "--iters", "2", timeout=1800)  # full fp32 policy + optimizer state per iteration
    assert (run / "policy/iter-0002/model.safetensors").is_file()
    roll = pq.read_table(sorted((run / "iter-0000/rollout").glob("part-*.parquet"))[0])
    text = " ".join(roll.column("completion").to_pylist())
    words = [w for w in text.split() if w.isalpha()]
    assert len(words) >= 10 and sum(w.lower() in _COMMON for w in words) >= 3, text


_COMMON = {"the", "a", "to", "of", "and", "is", "in", "we", "you", "it", "that", "this", "i", "for", "what", "are", "be", "so", "let",
           "has", "have", "how", "many", "total", "each", "there", "was"}


@pytest.mark.slow
def test_lora_zero3_update_over_two_processes_matches_one(assets, tmp_path):
    """Only the adapter trains under ZeRO-3, and 2 processes (torchrun) give 1 process's adapter."""
    from safetensors.torch import load_file

    from test_multiprocess_update import update_in_one_and_two_processes

    cfg = base_config(assets, rollout={"engine": "hf", "max_new_tokens": 16},
                      train={"mini_batch_size": 8, "lr": 1e-3, "zero_stage": 3, "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]}},
                      loss={"kl_coef": 0.05})
    single, multi = update_in_one_and_two_processes(tmp_path, cfg)
    a = load_file(single / "policy/iter-0001/adapter_model.safetensors")
    b = load_file(multi / "policy/iter-0001/adapter_model.safetensors")
    assert a.keys() == b.keys() and all("lora_" in n and ("q_proj" in n or "v_proj" in n) for n in a)
    moved = max(float(a[n].abs().max()) for n in a if "lora_B" in n)  # B starts at 0
    diff = max(float((a[n] - b[n]).abs().max()) for n in a)
    assert moved > 1e-3 and diff <= 1e-4, (moved, diff)  # float summation order, amplified by Adam (lr 1e-3)
    state = {p.name for p in (multi / "iter-0000/update/state/state").iterdir()}
    assert any("rank_1" in s and "optim" in s for s in state)


def test_lora_config_keys_and_their_one_line_errors(assets):
    from pipeline import config as config_mod
    from pipeline.errors import GRPOError

    cfg = config_mod.resolve(base_config(assets), ["train.lora={r: 4}"])
    assert cfg.train.lora.target_modules == "all-linear" and cfg.train.lora.alpha == 32.0 and cfg.rollout.lora_mode == "merged"
    assert config_mod.resolve(base_config(assets)).train.lora is None  # off by default
    bad = [
        (["train.lora={r: 4}", "ref_model=/elsewhere"], "leave ref_model unset"),
        (["rollout.lora_mode=vllm_lora"], "needs train.lora"),
        (["train.lora={r: 0}"], "train.lora.r"),
        (["train.lora={r: 4, rank: 8}"], "train.lora.rank: unknown key"),
    ]
    for sets, msg in bad:
        with pytest.raises(GRPOError, match=msg):
            config_mod.resolve(base_config(assets), sets)


@pytest.mark.slow
def test_lora_rollout_gets_the_merged_policy_in_memory_and_writes_no_merged_model(assets, tmp_path, monkeypatch):
    """`iterate` on a LoRA run (HF engine, tiny model): the engine of rollout 1 gets policy 1 merged
    into the base in memory; no merged model is written anywhere in the cache (it was, once per
    policy). The in-memory engine samples the tokens an engine started from the merged model
    written to disk (the old path) samples."""
    from pipeline import config as config_mod
    from pipeline.loop.iterate import iterate
    from pipeline.models.engines import make_engine, model_context
    from pipeline.run.lora import merge
    from pipeline.rollout import engine_max_len, policy_engine
    from pipeline.run.run import Run, init_run

    monkeypatch.setenv("GRPO_CACHE_DIR", str(tmp_path / "cache"))
    cfg = config_mod.resolve(base_config(assets, rollout={"engine": "hf", "max_new_tokens": 16},
                                         train={"lr": 1e-2, "lora": {"r": 4, "target_modules": ["q_proj", "v_proj"]}}))
    init_run(str(tmp_path / "run"), cfg)
    run = Run(str(tmp_path / "run"))
    iterate(run, 2)
    assert run.done(1, "update") and not list((tmp_path / "cache").rglob("model*.safetensors"))

    memory = policy_engine(run, 1)
    merge(run.policy_dir(0), run.policy_dir(1), tmp_path / "merged")
    disk = make_engine(tmp_path / "merged", cfg.rollout, engine_max_len(cfg, model_context(run.plain_dir(1))), cfg.seed,
                       precision=cfg.train.precision)
    assert not list((tmp_path / "cache").rglob("model*.safetensors"))
    prompts = pq.read_table(sorted((tmp_path / "run/iter-0001/rollout").glob("part-*.parquet"))[0]).column("prompt_ids").to_pylist()[:2]
    tokens = lambda engine: [[s.token_ids for s in group] for group in engine.generate(prompts, [11, 12], 2)]
    assert tokens(memory) == tokens(disk)
    base = make_engine(run.policy_dir(0), cfg.rollout, engine_max_len(cfg, model_context(run.plain_dir(0))), cfg.seed,
                       precision=cfg.train.precision)
    assert memory.probe(prompts[0]) != base.probe(prompts[0])  # the adapter moved the policy: not the base's weights
