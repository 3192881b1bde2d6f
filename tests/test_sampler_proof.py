"""A sampler that proves what it samples (pipeline/run/sampler_proof.py): strict weight loads, the
probe after every engine load, and the on-policy sampler gap as an error."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pipeline.errors import GRPOError


def _tied_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg)


def test_strict_loads_allow_only_the_tied_head_to_be_missing():
    from pipeline.models.strict import load_strict

    model, other = _tied_model(), _tied_model()
    state = {n: t + 1.0 for n, t in other.state_dict().items() if n != "lm_head.weight"}  # saved as save_pretrained saves it
    load_strict(model, state, "here")
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight, state["model.layers.0.mlp.up_proj.weight"])
    dropped = {n: t for n, t in state.items() if n != "model.layers.0.mlp.up_proj.weight"}
    with pytest.raises(GRPOError, match=r"^here: the weights do not match the model: missing model.layers.0.mlp.up_proj.weight \(1\)$"):
        load_strict(model, dropped, "here")
    with pytest.raises(GRPOError, match=r"unexpected lm_head.bias \(1\)"):
        load_strict(model, {**state, "lm_head.bias": torch.zeros(64)}, "here")
    model.config.tie_word_embeddings = False  # an untied head is a weight of its own
    with pytest.raises(GRPOError, match=r"missing lm_head.weight"):
        load_strict(model, state, "here")


def test_an_engine_load_missing_a_weight_is_an_error(assets, tmp_path):
    """The HF engine's reload of a directory whose safetensors lack a weight stops with one line
    naming the directory and the key (it was dropped silently by a non-strict load)."""
    from safetensors.torch import load_file, save_file

    from pipeline import config as config_mod
    from pipeline.models.hf_engine import HFEngine
    from tests.conftest import base_config

    import shutil

    cfg = config_mod.resolve(base_config(assets, rollout={"engine": "hf"}))
    bad = tmp_path / "bad"
    shutil.copytree(assets["model"], bad)
    f = next(bad.glob("*.safetensors"))
    state = load_file(f)
    name = next(n for n in state if "layers.0.self_attn.q_proj.weight" in n)
    save_file({n: t for n, t in state.items() if n != name}, f, metadata={"format": "pt"})
    engine = HFEngine(Path(assets["model"]), cfg.rollout, 256, 0)
    with pytest.raises(GRPOError, match=rf"^rollout engine: {bad}: the weights do not match the model: missing {name} \(1\)$"):
        engine.load(bad)
    engine.load(Path(assets["model"]))  # the complete directory loads


def test_the_background_writes_reference_is_the_stored_policys_and_gives_its_tensors_back(assets):
    """`iterate`'s background write computes the proof's reference from the tensors the file is
    written from (`reference_meanwhile`), on its thread: it must equal the reference of the stored
    files bit for bit, twice in a row on the kept model, and hold none of the tensors afterwards."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from pipeline.models.tokenizer_cache import tokenizer_of
    from pipeline.run.sampler_proof import _logprobs_of, probe_ids, reference_meanwhile

    model_dir = Path(assets["model"])
    tensors = {n: t.float() for n, t in load_file(model_dir / "model.safetensors").items()}
    ids = probe_ids(tokenizer_of(model_dir))
    stored = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = _logprobs_of(stored(input_ids=torch.tensor([ids])).logits[0, :-1].float(), ids)
    for _ in range(2):
        got_ids, got = reference_meanwhile(model_dir)(tensors, "policy/iter-0001")
        assert got_ids == tuple(ids) and got.tobytes() == want.tobytes()
    from pipeline.run import sampler_proof
    kept = next(iter(sampler_proof._SKELETON.values()))
    assert all(p.device.type == "meta" for p in kept.parameters())
    with pytest.raises(GRPOError, match="policy/iter-0001: the weights do not match the model: missing"):
        reference_meanwhile(model_dir)({n: t for n, t in tensors.items() if "norm" not in n}, "policy/iter-0001")


def test_the_sampler_gap_limit_follows_the_dtypes(assets):
    from pipeline import config as config_mod
    from pipeline.run.sampler_proof import check_sampler_gap, gap_limit
    from tests.conftest import base_config

    assert gap_limit("float32", "fp32") == 1e-3 and gap_limit("bfloat16", "fp32") == gap_limit("bf16") == 0.1
    fp32 = config_mod.resolve(base_config(assets, rollout={"engine": "hf", "dtype": "float32"}))
    check_sampler_gap(fp32, 2, [5e-4, 1e-3, 1e-3], "here")  # mean 8.3e-4: within fp32's 1e-3
    with pytest.raises(GRPOError, match=r"^here: on-policy iteration 2's sampler gap is 0.0015 .* over the 0.001 that a float32 engine "
                                        r"and fp32 trainer explain: the engine did not sample policy/iter-0002$"):
        check_sampler_gap(fp32, 2, [1e-3, 2e-3], "here")
    bf16 = config_mod.resolve(base_config(assets, rollout={"engine": "hf", "dtype": "bfloat16"}))
    check_sampler_gap(bf16, 2, [0.05], "here")
    with pytest.raises(GRPOError, match="0.3 .* over the 0.1 that a bfloat16 engine"):
        check_sampler_gap(bf16, 2, [0.3], "here")
    # an older behaviour policy or truncated sampling explains a gap of its own: not checked
    stale = config_mod.resolve(base_config(assets, rollout={"engine": "hf"}, train={"max_staleness": 1}))
    check_sampler_gap(stale, 2, [0.5], "here")
    check_sampler_gap(stale, 0, [1e-4], "here")
    with pytest.raises(GRPOError, match="iteration 0's sampler gap"):
        check_sampler_gap(stale, 0, [0.5], "here")  # iteration 0 is sampled by policy 0 itself
    top_p = config_mod.resolve(base_config(assets, rollout={"engine": "hf", "top_p": 0.9}, loss={"rollout_correction": {"mode": "none"}}))
    check_sampler_gap(top_p, 2, [0.5], "here")


def _iterate(run: Path, iters: int) -> tuple[int, str]:
    """`grpo iterate RUN --iters N` in this process (so a test can patch the engine): its exit code."""
    from stages.cli import main

    argv = sys.argv
    sys.argv = ["grpo", "iterate", str(run), "--iters", str(iters)]
    try:
        main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code or 0
    finally:
        sys.argv = argv
    return code


def test_a_sampler_that_never_loads_the_new_policy_stops_iterate(make_run, capsys, monkeypatch):
    """The transformers engine is real; only its reload does nothing (the bug: vLLM's reload once
    skipped the tied head; a non-strict load drops keys). Iteration 0 samples policy 0 as it should;
    iteration 1's engine still holds policy 0, and `iterate` stops there with one line naming the
    iteration and the gap, leaving no rollout of iteration 1. Then the same stale engine handed
    straight to the rollout (past the probe) is caught by the logprobs stage's sampler gap."""
    from pipeline.logprobs import run_logprobs
    from pipeline.models.hf_engine import HFEngine
    from pipeline.rollout import policy_engine, run_rollout
    from pipeline.score import run_score
    from pipeline.run.run import Run

    run = Path(make_run(rollout={"engine": "hf"}, train={"lr": 1e-3}))
    monkeypatch.setattr(HFEngine, "load", lambda self, model_dir, weights=None: setattr(self, "model_dir", Path(model_dir)))
    capsys.readouterr()
    assert _iterate(run, 2) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    import re

    m = re.fullmatch(r"error: rollout iteration 1: the float32 engine does not hold policy/iter-0001: its logprobs of a fixed "
                     r"(\d+)-token probe differ from the stored policy's by ([0-9.e+-]+) \(mean\), over the 0.001 its dtype explains "
                     r"\(a reload that left the old weights\?\)", lines[0])
    assert m, lines[0]
    assert int(m.group(1)) > 10 and float(m.group(2)) > 1e-3
    r = Run(str(run))
    assert r.done(0, "update") and not r.done(1, "rollout") and not list((run / "iter-0001").glob("rollout/part-*.parquet"))

    stale = policy_engine(r, 0)  # policy 0, handed to iteration 1's rollout as if it held policy 1
    run_rollout(r, 1, engine=stale)
    run_score(r, 1)
    with pytest.raises(GRPOError, match=r"^logprobs iteration 1 part 0: on-policy iteration 1's sampler gap is [0-9.e-]+ \(mean \|old - sampler\| "
                                        r"logprob\), over the 0.001 that a float32 engine and fp32 trainer explain: the engine did not "
                                        r"sample policy/iter-0001$"):
        run_logprobs(r, 1)
    assert not r.done(1, "logprobs")


def test_a_mixture_of_experts_reloads_in_place_through_the_checkpoint_conversion(tmp_path):
    """transformers 5 fuses a MoE's per-expert weights as it loads them, while save_pretrained
    writes them per expert: reading the files as they are matched no key of the loaded model (the
    strict load refused Mixtral at the second iteration; the old non-strict one kept the old experts).
    The reload now goes through from_pretrained's conversion and gives exactly the stored policy."""
    import torch
    from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM

    from pipeline.models.strict import load_dir_strict

    conf = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1)
    torch.manual_seed(0)
    MixtralForCausalLM(conf).save_pretrained(tmp_path / "a")
    torch.manual_seed(1)
    MixtralForCausalLM(conf).save_pretrained(tmp_path / "b")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a", dtype=torch.float32)
    want = AutoModelForCausalLM.from_pretrained(tmp_path / "b", dtype=torch.float32).state_dict()
    assert any(not torch.equal(v, want[k]) for k, v in model.state_dict().items())
    load_dir_strict(model, tmp_path / "b", "logprobs: policy/iter-0001")
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
