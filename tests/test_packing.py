"""Padding-free batches (train.packing): the packed layout, its exactness against right-padded
batches, the negative control without position resets, and packed against padded `iterate`."""

import pytest
import torch

from pipeline.errors import GRPOError
from pipeline.models import packing
from pipeline.models.packing import Packed, Pieces
from pipeline.models.tokens import Batch, shared_budget_batches, token_logprobs
from test_perf import _groups, _model, _outputs_and_grads

# fp32 rounding between the paths: the padded forward's masked SDPA runs torch's math kernel on
# [B, L] rows, the packed one its flash kernel per sequence, and the matmuls see other shapes, so
# sums run in another order. Measured on the tiny Qwen2: logprobs 4.8e-7 apart (1 ulp at |logp|
# ~5.7), entropies 2.4e-6, gradients 9.5e-7; the bounds below are those, rounded up.
LOGP_ATOL, ENT_ATOL, GRAD_ATOL = 1e-6, 5e-6, 2e-6


def test_the_layout_restarts_positions_and_shares_a_prompt():
    """Rows 0 and 2 share prompt [5, 6, 7]; row 1 has its own. A completion's last token is not
    run (it predicts nothing); the prompt's last token predicts each completion's first."""
    p = Packed.build([[5, 6, 7], [8, 9], [5, 6, 7]], [[1, 2, 3], [4], [11, 12]])
    assert p.input_ids.tolist() == [[5, 6, 7, 1, 2, 11, 8, 9]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 0, 1]]
    # (row, t) in [B, T] order: (0,0) (0,1) (0,2) (1,0) (2,0) (2,1)
    assert p.src.tolist() == [2, 3, 4, 7, 2, 5]
    assert Pieces.from_positions(p.position_ids[0].tolist()).runs == [(0, 5, 0, 0), (5, 6, 0, 3), (6, 8, 6, 0)]
    unshared = Packed.build([[5, 6, 7], [8, 9], [5, 6, 7]], [[1, 2, 3], [4], [11, 12]], share=False)
    assert unshared.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 0, 1, 2, 3]]
    assert unshared.tokens == packing.real_tokens([[5, 6, 7], [8, 9], [5, 6, 7]], [[1, 2, 3], [4], [11, 12]], share=False) == 11
    with pytest.raises(ValueError, match="token 2 continues position 4"):
        Pieces.from_positions([0, 1, 5])  # a branch past its root's end


@pytest.mark.parametrize("share", [False, True])
def test_packed_logprobs_entropies_and_gradients_equal_padded(share):
    prompts, comps = _groups()  # 3 prompts interleaved, uneven completions, one empty
    padded = Batch.build(prompts, comps)
    packed = Batch.build(prompts, comps, share_prompts=share, packed=True)
    assert packed.packed.tokens == packing.real_tokens(prompts, comps, share) == (61 if share else 109) < 204 == padded.input_ids.numel()
    outs, grads = _outputs_and_grads(
        [lambda m, b=b: token_logprobs(m, b, 0.7, with_entropy=True) for b in (padded, packed)], seed=4)
    (lp0, e0), (lp1, e1) = outs
    m = padded.completion_mask.bool()
    assert (lp1[~m] == 0).all() and (lp1[m] < 0).all()
    assert (lp0 - lp1).abs().max() <= LOGP_ATOL and (e0 - e1).abs().max() <= ENT_ATOL
    for name, g0 in grads[0].items():
        assert g0.abs().sum() > 0 and (g0 - grads[1][name]).abs().max() <= GRAD_ATOL, name


@pytest.mark.parametrize("share", [False, True])
def test_negative_control_without_position_resets_the_rows_read_each_other(share):
    """The same packed batch with positions running on (no reset per sequence): the attention
    takes the whole batch for one sequence, and the logprobs move by far more than the rounding
    the exactness test allows, so that test would catch lost resets (TRL's #7087 saw 6e-2)."""
    prompts, comps = _groups()
    model = _model(4)
    padded = Batch.build(prompts, comps)
    broken = Batch.build(prompts, comps, share_prompts=share, packed=True)
    broken.packed = Packed.build(prompts, comps, share, reset_positions=False)
    assert Pieces.from_positions(broken.packed.position_ids[0].tolist()).runs == [(0, broken.packed.tokens, 0, 0)]
    with torch.no_grad():
        diff = (token_logprobs(model, padded, 0.7)[0] - token_logprobs(model, broken, 0.7)[0]).abs()
    assert diff.max() > 1e-2 > 100 * LOGP_ATOL
    first = [i for i, p in enumerate(prompts) if p == prompts[0]][:1 if share else 1]
    assert diff[first].max() <= LOGP_ATOL  # the first sequence has nothing before it to read


def test_packed_budget_counts_real_tokens():
    p, q = [1] * 50, [2] * 40
    # shared prompt p once + 4 completions of 10 (9 run each): 50 + 36 = 86 tokens
    assert shared_budget_batches([p] * 4, [[3] * 10] * 4, 86, packed=True) == [[0, 1, 2, 3]]
    assert shared_budget_batches([p] * 4, [[3] * 10] * 4, 85, packed=True) == [[0, 1, 2], [3]]
    # uneven completions cost their own lengths, not rows x the longest: 50 + 99 + 0 + 40 + 40 = 229
    assert shared_budget_batches([p, p, q], [[3] * 100, [3], [3] * 41], 229, packed=True) == [[0, 1, 2]]
    assert shared_budget_batches([p, p, q], [[3] * 100, [3], [3] * 41], 228, packed=True) == [[0, 1], [2]]
    # padded: rows 0, 1 cost 50 + 2 x 100 = 250; rows 1, 2 (nothing shared) 2 x (50 + 41) = 182
    assert shared_budget_batches([p, p, q], [[3] * 100, [3], [3] * 41], 229, packed=False) == [[0], [1, 2]]


def test_packing_setting_resolves_per_model():
    model = _model(0)
    assert packing.resolve("auto", model) and packing.resolve("on", model) and not packing.resolve("off", model)
    model.config._attn_implementation = "eager"
    assert not packing.resolve("auto", model)
    with pytest.raises(GRPOError, match="train.packing on: .*'eager' attention"):
        packing.resolve("on", model)


def test_packed_model_keeps_padded_forwards_unchanged():
    """Once a model packs, its attention implementation is `grpo_packed`; a padded forward then
    runs transformers' SDPA with the same masks: bit-identical to before."""
    prompts, comps = _groups()
    model = _model(4)
    padded = Batch.build(prompts, comps, share_prompts=True)
    with torch.no_grad():
        before = token_logprobs(model, padded, 0.7)[0]
        token_logprobs(model, Batch.build(prompts, comps, packed=True), 0.7)
        assert model.config._attn_implementation == packing.ATTENTION
        assert torch.equal(before, token_logprobs(model, padded, 0.7)[0])


@pytest.mark.slow
def test_packed_and_padded_iterate_write_the_same_parts_and_update_metrics(make_run):
    """Two iterations each way: the rollout and score parts hold the same rows (their metadata
    differs only in the config hash; iteration 1's sampler logprobs and policy hash come from
    two policies equal to fp32 rounding), so policy 1 of either update samples the same completions; the
    logprobs agree to fp32 rounding and every update metric to its rounding (rel 1e-4)."""
    import math
    from pathlib import Path

    import pyarrow.parquet as pq

    from pipeline.loop.iterate import iterate
    from pipeline.run.run import Run

    small = {"engine": "hf", "max_new_tokens": 12, "prompts_per_iter": 2, "groups_per_part": 1}
    runs = {mode: Run(make_run(mode, rollout=small, train={"packing": mode})) for mode in ("on", "off")}
    for run in runs.values():
        iterate(run, 2)
    on, off = (Path(runs[m].uri) for m in ("on", "off"))
    read = lambda p: pq.read_table(p).replace_schema_metadata(None)
    for k in range(2):
        for stage in ("rollout", "score"):
            parts = sorted((on / f"iter-{k:04d}/{stage}").glob("part-*.parquet"))
            assert parts, (k, stage)
            for p in parts:
                a, b = read(p), read(off / p.relative_to(on))
                if k == 1 and stage == "rollout":  # policy 1 differs in its last bits: so do its hash and the sampler's logprobs
                    for x, y in zip(a.column("sampler_logprobs").to_pylist(), b.column("sampler_logprobs").to_pylist()):
                        assert len(x) == len(y) and max((abs(u - v) for u, v in zip(x, y)), default=0) <= 1e-4
                    a, b = (t.drop_columns(["sampler_logprobs", "policy_hash"]) for t in (a, b))
                assert a.equals(b), (k, stage, p.name)
        for p in sorted((on / f"iter-{k:04d}/logprobs").glob("part-*.parquet")):
            for ra, rb in zip(read(p).to_pylist(), read(off / p.relative_to(on)).to_pylist()):
                for col in ("old_logprobs", "ref_logprobs"):
                    assert (ra[col] is None) == (rb[col] is None), (k, col)
                    if ra[col]:
                        assert max(abs(x - y) for x, y in zip(ra[col], rb[col])) <= 1e-5, (k, col)
        ma, mb = (read(d / f"iter-{k:04d}/update/metrics.parquet").to_pylist() for d in (on, off))
        assert len(ma) == len(mb) >= 1
        for ra, rb in zip(ma, mb):
            for key, v in ra.items():
                if isinstance(v, float) and not math.isnan(v):
                    assert v == pytest.approx(rb[key], rel=1e-4, abs=1e-6), (k, key)
                else:
                    assert v == rb[key] or (isinstance(v, float) and math.isnan(rb[key])), (k, key)


def tiny_config(model_type: str, **kw):
    """A two-layer config of `model_type` (kw override the sizes)."""
    import transformers

    return transformers.AutoConfig.for_model(model_type, **{**dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128), **kw})


def _tiny(model_type: str, **kw):
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(model_type, **kw), attn_implementation="sdpa").float().eval()


@pytest.mark.parametrize("model_type,kw,ran", [
    # a hybrid: its linear-attention layer runs the packed row as one sequence (logprobs 2.8e-3 off before the check)
    ("qwen3_5_text", dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=2,
                          linear_key_head_dim=8, linear_value_head_dim=8, head_dim=8), 1),
    # Falcon's own attention classes ignore the pieces: every row read the rows before it (9.6e-2 off)
    ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2), 0),
])
def test_a_model_that_mixes_tokens_outside_the_packed_attention_cannot_pack(model_type, kw, ran):
    model = _tiny(model_type, **kw)
    prompts, comps = _groups()
    with pytest.raises(GRPOError, match=f"train.packing: {ran} of this model's 2 layers \\({model_type}\\) ran the packed attention"):
        with torch.no_grad():
            token_logprobs(model, Batch.build(prompts, comps, share_prompts=True, packed=True), 1.0)
    # both say so up front (its layer types; Falcon's modeling module has no attention interface): auto pads, on is refused
    assert not packing.resolve("auto", model)
    with pytest.raises(GRPOError, match="cannot pack"):
        packing.resolve("on", model)


def test_auto_packing_pads_a_falcon_instead_of_failing_its_first_forward():
    """The bug: `auto` resolved Falcon (SDPA, but its own attention classes) to packed, and the first forward
    raised "0 of this model's 2 layers ran the packed attention"; now auto pads it and the forward runs."""
    model = _tiny("falcon", new_decoder_architecture=True, num_kv_heads=2)
    prompts, comps = _groups()
    packed = packing.resolve("auto", model)
    assert packed is False
    with torch.no_grad():
        logp, _ = token_logprobs(model, Batch.build(prompts, comps, share_prompts=True, packed=packed), 1.0)  # [B, T]
    assert logp.shape == (len(comps), max(map(len, comps))) and torch.isfinite(logp).all()
    assert packing.resolve("auto", _tiny("qwen2"))  # a model that can pack still packs under auto


def test_a_model_whose_rope_follows_the_batch_length_pads():
    """The bug: `auto` packed a dynamic-NTK llama. Its rope frequencies follow the forward's largest
    position id: the padded batch's is the longest row's last token, the packed one's a token less
    (a completion's last token is not run), so past max_position_embeddings the two forwards rotate
    by other frequencies (logprobs 8.6e-6, gradients 1.5e-4 apart on this model, 20x and 75x the
    rounding bounds above). Longrope (Phi-3) switches factors on the same number. Auto pads them; on is refused."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 300, (n,), generator=g).tolist() for n in (10, 10, 12)]
    prompts[1] = prompts[0]
    comps = [torch.randint(1, 300, (n,), generator=g).tolist() for n in (10, 4, 8)]  # longest row 20 > 16
    make = lambda seed: _tiny("llama", max_position_embeddings=16, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    outs, _ = _outputs_and_grads([lambda m, b=b: token_logprobs(m, b, 0.7, with_entropy=True) for b in
                                  (Batch.build(prompts, comps), Batch.build(prompts, comps, share_prompts=True, packed=True))],
                                 seed=0, make_model=make)
    assert (outs[0][0] - outs[1][0]).abs().max() > 5 * LOGP_ATOL  # what packing it would cost
    for rope in ({"rope_type": "dynamic", "factor": 2.0},
                 {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4, "original_max_position_embeddings": 16}):
        model = _tiny("llama", max_position_embeddings=32, rope_scaling=rope)
        assert not packing.resolve("auto", model), rope
        with pytest.raises(GRPOError, match="cannot pack"):
            packing.resolve("on", model)
    assert packing.resolve("auto", _tiny("llama", rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}))
