"""Memory and precision levers: chunked logprobs, token-budget pieces, bf16 autocast."""

import os
from pathlib import Path

import pytest
import torch

from pipeline.objective import loss as grpo
from pipeline.config.loss import LossConfig
from pipeline.models import tokens
from pipeline.models.tokens import Batch, token_logprobs
from pipeline.schedule import old_from_update


def _model(seed: int = 0, vocab: int = 300):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg).float()


def _batch(seed: int = 1, vocab: int = 300) -> Batch:
    g = torch.Generator().manual_seed(seed)
    plen, clen = [3, 7, 5, 4], [9, 2, 6, 0]  # the last completion is empty: all padding
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in plen]
    comps = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in clen]
    return Batch.build(prompts, comps)


def _naive(model, batch: Batch, temperature: float):
    """Full [B, L, V] log-softmax, the textbook way."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float() / temperature
    logp_all = torch.log_softmax(logits, -1)  # [B, L, V]
    B, T = batch.completion_ids.shape
    pos = (batch.starts.unsqueeze(1) - 1 + torch.arange(T)).clamp(max=logits.shape[1] - 1)  # [B, T]
    lp = logp_all.gather(1, pos.unsqueeze(-1).expand(B, T, logits.shape[-1]))  # [B, T, V]
    tok = lp.gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1) * batch.completion_mask
    ent = -(lp.exp() * lp).sum(-1) * batch.completion_mask
    return tok, ent


def _outputs_and_grads(fns, seed: int, make_model=None):
    """For each fn(model) -> (logp, entropy) on a fresh model of `seed` (`make_model(seed)`, else
    `_model`): the outputs and every trainable parameter's gradient of a loss that weighs each
    token's logprob and entropy differently."""
    outs, grads = [], []
    for fn in fns:
        model = (make_model or _model)(seed)
        logp, ent = fn(model)
        w = torch.arange(logp.numel(), dtype=torch.float32).reshape(logp.shape) / logp.numel()
        ((logp * w).sum() - 0.3 * (ent * w).sum()).backward()
        outs.append((logp.detach(), ent.detach()))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    return outs, grads


@pytest.mark.parametrize("chunk, row_block", [(1, 128), (5, 2), (4096, 3), (4096, 128)])
def test_chunked_logprobs_and_gradients_match_the_full_log_softmax(chunk, row_block, monkeypatch):
    monkeypatch.setattr(tokens, "ROW_BLOCK", row_block)  # the softmax arithmetic over several row blocks of a chunk
    batch = _batch()
    outs, grads = _outputs_and_grads(
        (lambda m: _naive(m, batch, 0.7), lambda m: token_logprobs(m, batch, 0.7, with_entropy=True, chunk=chunk)), seed=0)
    (lp0, e0), (lp1, e1) = outs
    assert lp0.shape == lp1.shape == (4, 9)
    assert torch.allclose(lp0, lp1, atol=1e-5, rtol=0)
    assert torch.allclose(e0, e1, atol=1e-5, rtol=0)
    assert (lp1[3] == 0).all() and (lp1[1, 2:] == 0).all()  # padding holds exactly 0
    assert (lp1[0] < 0).all()
    for name, g0 in grads[0].items():
        assert torch.allclose(g0, grads[1][name], atol=1e-5, rtol=1e-4), name


def _groups(seed: int = 7, vocab: int = 300):
    """Three prompts of different lengths, each with completions of different lengths (one empty),
    interleaved so rows of a prompt are not adjacent."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (3, 8, 5)]
    rows = [(p, c) for p in range(3) for c in (6, 1, 9, 0 if p == 1 else 4)]
    rows = rows[::2] + rows[1::2]
    return [prompts[p] for p, _ in rows], [torch.randint(1, vocab, (n,), generator=g).tolist() for _, n in rows]


def test_shared_prompts_give_the_logprobs_entropies_and_gradients_of_full_sequences():
    """Each distinct prompt runs once (a KV cache its rows index into); logprobs, entropies and
    every parameter's gradient equal the textbook full forward over prompt + completion."""
    prompts, comps = _groups()
    shared = Batch.build(prompts, comps, share_prompts=True)
    assert shared.prompts is not None and shared.prompts.input_ids.shape == (3, 8)
    assert shared.prompts.row.tolist() == [0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 2, 2]
    assert Batch.build(prompts[:1], comps[:1], share_prompts=True).prompts is None  # nothing shared
    outs, grads = _outputs_and_grads(
        (lambda m: _naive(m, Batch.build(prompts, comps), 0.7), lambda m: token_logprobs(m, shared, 0.7, with_entropy=True)), seed=4)
    (lp0, e0), (lp1, e1) = outs
    m = shared.completion_mask.bool()
    assert lp1.shape == (12, 9) and (lp1[~m] == 0).all() and (lp1[m] < 0).all()
    assert torch.allclose(lp0, lp1, atol=1e-5, rtol=0) and torch.allclose(e0, e1, atol=1e-5, rtol=0)
    for name, g0 in grads[0].items():
        assert g0.abs().sum() > 0 and torch.allclose(g0, grads[1][name], atol=1e-6, rtol=1e-4), name


def test_shared_budget_counts_a_shared_prompt_once():
    from pipeline.models.tokens import shared_budget_batches

    p, q = [1] * 50, [2] * 40
    # 4 rows of p (10-token completions): 50 + 4 x 10 = 90 tokens shared, 4 x 60 = 240 unshared
    assert shared_budget_batches([p] * 4, [[3] * 10] * 4, 90) == [[0, 1, 2, 3]]
    assert shared_budget_batches([p] * 4, [[3] * 10] * 4, 89) == [[0, 1, 2], [3]]  # 3 rows: 80; the 4th alone: 60
    # distinct prompts share nothing: rows x longest prompt + completion
    assert shared_budget_batches([p, q], [[3] * 10, [3] * 10], 119) == [[0], [1]]
    assert shared_budget_batches([p, q, q], [[3] * 10, [3] * 10, [3] * 10], 130) == [[0, 1, 2]]  # 2 x 50 + 3 x 10


def movement(w0: dict, wa: dict, wb: dict) -> tuple[float, float]:
    """(how far update A moved the weights, ||A - B|| / ||A - w0||): two updates that should agree
    compared in norm over every weight. A max over single weights is not a fair measure after
    Adam: a weight whose gradient is ~0 moves by about lr in the direction of its sign, which float
    reduction order decides, so one such weight can differ by ~lr between agreeing updates (seen
    on an AMX CPU, whose oneDNN kernels sum in another order than AVX512-bf16 ones)."""
    import math

    moved = math.sqrt(sum(float(((wa[n] - w0[n]).double() ** 2).sum()) for n in wa))
    apart = math.sqrt(sum(float(((wa[n] - wb[n]).double() ** 2).sum()) for n in wa))
    return moved, apart / max(moved, 1e-30)


def test_the_heads_fast_fp32_matmul_keeps_logprobs_and_gradients_at_fp32_accuracy():
    """bf16 runs the LM head's fp32 matmuls on oneDNN's bf16 units (on a CPU); the logprobs,
    entropies and gradients stay within float noise of plain fp32 at real logit sizes (|z| ~ 20)."""
    from pipeline.models.tokens import _Head

    g = torch.Generator().manual_seed(0)
    h = torch.randn(300, 576, generator=g) * 2.0
    w = torch.randn(5000, 576, generator=g) * 0.1
    ids = torch.randint(0, 5000, (300,), generator=g)
    out = {}
    for fast in (False, True):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, ent = _Head.apply(hh, ww, None, ids, 0.9, True, fast)
        (lp.sum() + 0.1 * ent.sum()).backward()
        out[fast] = (lp.detach(), ent.detach(), hh.grad, ww.grad)
    assert float(torch.nn.functional.linear(h, w).abs().max()) > 10  # logits of a real model's size
    for a, b in zip(out[False], out[True]):
        assert torch.allclose(a, b, atol=1e-3, rtol=1e-3)


def test_chunked_logprobs_without_grad_match_with_grad():
    batch, model = _batch(2), _model(3)
    with torch.no_grad():
        a, _ = token_logprobs(model, batch, 1.0, chunk=3)
    b, _ = token_logprobs(model, batch, 1.0, chunk=3)
    assert b.requires_grad and torch.equal(a, b.detach())


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_token_budget_pieces_give_the_micro_batch_gradient(loss_type):
    """The update cuts a micro-batch into pieces; their weighted losses' gradient is the whole one's."""
    batch_rows = _batch(4)
    prompts = [batch_rows.input_ids[i, : int(batch_rows.starts[i])].tolist() for i in range(4)]
    comps = [batch_rows.completion_ids[i, : int(batch_rows.completion_mask[i].sum())].tolist() for i in range(4)]
    rows = [0, 1, 2]  # rows with completions
    cfg = LossConfig(type=loss_type)
    adv = torch.tensor([1.0, -0.5, 0.25])
    torch.manual_seed(0)
    olds = [torch.randn(len(comps[i])) * 0.05 for i in rows]  # old = current - small noise: ratios near 1, unclipped

    def loss_of(model, idx):
        b = Batch.build([prompts[rows[i]] for i in idx], [comps[rows[i]] for i in idx])
        T = b.completion_mask.shape[1]
        old = torch.zeros(len(idx), T)
        for j, i in enumerate(idx):
            old[j, : len(olds[i])] = olds[i]
        logp, _ = token_logprobs(model, b, 1.0)
        loss, _ = grpo.policy_loss(logp, old + logp.detach(), adv[idx], b.completion_mask, cfg,
                                   max_completion_length=9, num_items=17.0)
        return loss, float(b.completion_mask.sum())

    whole = _model()
    loss_of(whole, [0, 1, 2])[0].backward()
    split = _model()
    tokens = sum(len(comps[i]) for i in rows)
    for piece in ([0], [1, 2]):
        loss, n = loss_of(split, piece)
        (loss * grpo.loss_type(cfg).piece_share(len(piece) / 3, n / tokens)).backward()
    assert whole.model.embed_tokens.weight.grad.abs().sum() > 1e-3
    for (name, p0), p1 in zip(whole.named_parameters(), split.parameters()):
        assert torch.allclose(p0.grad, p1.grad, atol=1e-6, rtol=1e-4), name


def test_bf16_autocast_logprobs_stay_close_to_fp32_and_fp32_in_dtype():
    from pipeline.models.tokens import resolve_precision

    batch, model = _batch(5), _model(6)
    with torch.no_grad():
        fp32, e32 = token_logprobs(model, batch, 0.7, with_entropy=True)
        bf16, e16 = token_logprobs(model, batch, 0.7, with_entropy=True, precision="bf16")
    assert bf16.dtype == e16.dtype == torch.float32
    m = batch.completion_mask.bool()
    dev = (bf16 - fp32).abs()[m]
    assert 0 < dev.max() < 0.05  # bf16 arithmetic did happen, and the LM head stayed fp32
    assert (bf16[~m] == 0).all()
    assert resolve_precision("fp32") == "fp32" and resolve_precision("bf16") == "bf16"
    assert resolve_precision("auto") in ("fp32", "bf16")


def test_bf16_and_fp32_logprobs_stages_write_the_same_schema(make_run):
    """The logprobs stage under each precision: same columns and types, records which it used,
    and the bf16 old logprobs stay near the fp32 ones."""
    from pathlib import Path

    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.logprobs import run_logprobs
    from pipeline.rollout import run_rollout
    from pipeline.run.run import Run
    from pipeline.score import run_score

    tables, manifests = {}, {}
    for precision in ("fp32", "bf16"):
        path = make_run(precision, rollout={"engine": "hf", "dtype": "float32"}, train={"precision": precision})  # the same rollout under both
        run = Run(path)
        run_rollout(run, 0)
        run_score(run, 0)
        manifests[precision] = run_logprobs(run, 0)
        parts = sorted((Path(path) / "iter-0000/logprobs").glob("*.parquet"))
        assert parts
        tables[precision] = pa.concat_tables([pq.read_table(p) for p in parts])
    assert tables["fp32"].schema == tables["bf16"].schema
    assert manifests["fp32"].inputs["precision"] == "fp32" and manifests["bf16"].inputs["precision"] == "bf16"
    a = tables["fp32"].column("old_logprobs").to_pylist()
    b = tables["bf16"].column("old_logprobs").to_pylist()
    assert [len(x) for x in a] == [len(x) for x in b] and sum(len(x) for x in a) > 0
    dev = max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    assert 0 < dev < 0.1


def test_iteration_zero_makes_one_logprobs_pass_equal_to_a_separate_reference_pass(make_run):
    """At iteration 0 the old policy is the reference: the stage computes it once, the manifest
    says so, and the values are what a separate pass over the reference model gives."""
    import numpy as np
    import pyarrow as pa

    from pipeline.logprobs import run_logprobs, sequence_logprobs
    from pipeline.run.policy import load_model
    from pipeline.run.parts import read_parts
    from pipeline.rollout import run_rollout
    from pipeline.run.run import Run
    from pipeline.score import run_score
    from schemas.artifacts import LOGPROBS, ROLLOUT

    run = Run(make_run("kl", rollout={"engine": "hf"}, loss={"kl_coef": 0.05}, train={"precision": "fp32"}))
    run_rollout(run, 0)
    run_score(run, 0)
    m = run_logprobs(run, 0)
    assert m.passes["forward_passes"] == 1 and m.passes["ref_logprobs"].startswith("= old_logprobs")
    lp = pa.concat_tables(read_parts(run, 0, "logprobs", LOGPROBS))
    roll = pa.concat_tables(read_parts(run, 0, "rollout", ROLLOUT))
    old, ref = lp.column("old_logprobs").to_pylist(), lp.column("ref_logprobs").to_pylist()
    assert old == ref and sum(len(r) for r in ref) > 0
    separate = sequence_logprobs(load_model(run.ref_dir()), roll.column("prompt_ids").to_pylist(),
                                 roll.column("completion_ids").to_pylist(), run.cfg.rollout.temperature, 64)
    for r, s in zip(ref, separate):
        assert np.allclose(np.asarray(r, np.float32), s, atol=1e-5)


def test_one_step_update_takes_the_old_logprobs_from_its_forward_equal_to_a_separate_pass(make_run):
    """One epoch and one optimizer step per iteration: the ratio is exactly 1, so the logprobs
    stage makes no old pass (its manifest says so, the column is null) and the update uses its
    own forward, detached, storing what it used. Those values equal a separate pass over the
    same policy, the ratio is exactly 1, and `train.old_logprobs: pass` keeps the separate pass."""
    import numpy as np
    import pyarrow as pa

    from pipeline.logprobs import run_logprobs, sequence_logprobs
    from pipeline.run.policy import load_model
    from pipeline.report.audit import audit_run
    from pipeline.report.inspect import stage_metrics
    from pipeline.rollout import run_rollout
    from pipeline.score import run_score
    from pipeline.store import canonical_hash, hash_dir
    from pipeline.run.parts import read_parts
    from pipeline.run.run import Run
    from pipeline.update.publish import run_update
    from schemas.artifacts import LOGPROBS, ROLLOUT, UPDATE_METRICS

    one_step = {"mini_batch_size": 16, "grad_accum": 2, "precision": "fp32"}  # 4 prompts x G=4 = 16 rows
    runs = {mode: Run(make_run(mode, rollout={"engine": "hf"}, train={**one_step, "old_logprobs": mode})) for mode in ("auto", "pass")}
    auto, sep = runs["auto"], runs["pass"]
    assert old_from_update(auto.cfg) and not old_from_update(sep.cfg)
    trainer, state_hashes = None, []
    for k in range(2):
        run_rollout(auto, k)
        run_score(auto, k)
        m = run_logprobs(auto, k)
        assert m.passes["forward_passes"] == 0 and "update's forward" in m.passes["old_logprobs"], m.passes
        lp = pa.concat_tables(read_parts(auto, k, "logprobs", LOGPROBS))
        assert lp.column("old_logprobs").null_count == lp.num_rows == lp.column("sampler_gap_max").null_count
        separate = sequence_logprobs(load_model(auto.policy_dir(k)), *(
            pa.concat_tables(read_parts(auto, k, "rollout", ROLLOUT)).column(c).to_pylist() for c in ("prompt_ids", "completion_ids")),
            auto.cfg.rollout.temperature, 64)
        um, trainer = run_update(auto, k, trainer)
        assert um.outputs.old_logprobs is not None
        used = auto.store.read_table(f"iter-{k:04d}/update/old_logprobs.parquet", LOGPROBS, um.outputs.old_logprobs.sha256)
        roll = pa.concat_tables(read_parts(auto, k, "rollout", ROLLOUT))
        by_key = dict(zip(zip(used.column("prompt_id").to_pylist(), used.column("sample_idx").to_pylist()), used.to_pylist()))
        keys = list(zip(roll.column("prompt_id").to_pylist(), roll.column("sample_idx").to_pylist()))
        assert sorted(by_key) == sorted(keys) and sum(len(s) for s in separate) > 0
        for key, s, sampler in zip(keys, separate, roll.column("sampler_logprobs").to_pylist()):
            row = by_key[key]
            assert np.allclose(np.asarray(row["old_logprobs"], np.float32), s, atol=1e-4), key
            gap = np.abs(np.asarray(row["old_logprobs"], np.float32) - np.asarray(sampler, np.float32))
            assert row["sampler_gap_max"] == pytest.approx(float(gap.max()) if len(gap) else 0.0, abs=1e-6)
        steps = auto.store.read_table(f"iter-{k:04d}/update/metrics.parquet", UPDATE_METRICS).to_pylist()
        assert len(steps) == 1 and steps[0]["ratio/mean"] == 1.0 and steps[0]["clip/ratio_region"] == 0.0
        # the trainer state's hash is recorded when it is written, and the next update resumes from it
        assert um.outputs.state == canonical_hash(hash_dir(Path(auto.uri) / f"iter-{k:04d}/update/state"))
        assert um.inputs.state == (None if k == 0 else state_hashes[k - 1])
        state_hashes.append(um.outputs.state)
        assert "logprobs/sampler_gap_max" not in stage_metrics(auto, k, "logprobs")  # the update reports it
        assert stage_metrics(auto, k, "update")["logprobs/sampler_gap_max"] == pytest.approx(max(used.column("sampler_gap_max").to_pylist()))

    run_rollout(sep, 0)
    run_score(sep, 0)
    m = run_logprobs(sep, 0)
    assert m.passes["forward_passes"] == 1 and m.passes["old_logprobs"] == "policy/iter-0000"
    um, _ = run_update(sep, 0)
    assert um.outputs.old_logprobs is None and not (Path(sep.uri) / "iter-0000/update/old_logprobs.parquet").exists()
    sep_old = pa.concat_tables(read_parts(sep, 0, "logprobs", LOGPROBS)).column("old_logprobs").to_pylist()
    auto_old = auto.store.read_table("iter-0000/update/old_logprobs.parquet", LOGPROBS)
    auto_old = dict(zip(zip(auto_old.column("prompt_id").to_pylist(), auto_old.column("sample_idx").to_pylist()), auto_old.column("old_logprobs").to_pylist()))
    roll = pa.concat_tables(read_parts(sep, 0, "rollout", ROLLOUT))
    for key, o in zip(zip(roll.column("prompt_id").to_pylist(), roll.column("sample_idx").to_pylist()), sep_old):
        assert np.allclose(np.asarray(auto_old[key]), np.asarray(o), atol=1e-4), key  # same rollout: same policy 0

    assert audit_run(auto).ok and audit_run(sep).ok
    target = Path(auto.uri) / "iter-0001/update/old_logprobs.parquet"
    target.write_bytes(target.read_bytes()[:-9] + b"x" + target.read_bytes()[-8:])
    assert any(p.startswith(f"{auto.store.display('iter-0001/update/old_logprobs.parquet')}: sha256") or "old_logprobs.parquet: sha256" in p
               for p in audit_run(auto).problems)


def test_one_step_per_epoch_takes_the_old_logprobs_from_the_first_epoch(make_run):
    """Two epochs of one optimizer step each: the first epoch's forwards all run on the old policy,
    so the update takes them as the old logprobs and the second epoch reuses them. The logprobs
    stage makes no pass, and the update (its per-step metrics and the policy it writes) is the one
    a separate old pass gives, within float tolerance; the second step's ratio is not 1."""
    import numpy as np
    import pyarrow as pa
    from safetensors.torch import load_file

    from pipeline.logprobs import run_logprobs
    from pipeline.report.audit import audit_run
    from pipeline.rollout import run_rollout
    from pipeline.score import run_score
    from pipeline.run.parts import read_parts
    from pipeline.run.run import Run
    from pipeline.update.publish import run_update
    from schemas.artifacts import LOGPROBS, UPDATE_METRICS

    two = {"epochs": 2, "mini_batch_size": 16, "grad_accum": 2, "precision": "fp32", "lr": 1e-3}  # 4 prompts x G=4
    runs = {mode: Run(make_run(f"e2-{mode}", rollout={"engine": "hf"}, train={**two, "old_logprobs": mode})) for mode in ("auto", "pass")}
    auto, sep = runs["auto"], runs["pass"]
    assert old_from_update(auto.cfg) and not old_from_update(sep.cfg)
    steps = {}
    for mode, run in runs.items():
        run_rollout(run, 0)
        run_score(run, 0)
        m = run_logprobs(run, 0)
        assert m.passes["forward_passes"] == (0 if mode == "auto" else 1), m.passes
        um, _ = run_update(run, 0)
        assert (um.outputs.old_logprobs is not None) == (mode == "auto")
        steps[mode] = run.store.read_table("iter-0000/update/metrics.parquet", UPDATE_METRICS).to_pylist()
    assert [s["epoch"] for s in steps["auto"]] == [s["epoch"] for s in steps["pass"]] == [0, 1]
    assert steps["auto"][0]["ratio/mean"] == 1.0 and abs(steps["auto"][1]["ratio/mean"] - 1.0) > 1e-6
    for a, b in zip(steps["auto"], steps["pass"]):
        for key in ("loss/policy", "ratio/mean", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-5), key
    sep_old = pa.concat_tables(read_parts(sep, 0, "logprobs", LOGPROBS))
    auto_old = auto.store.read_table("iter-0000/update/old_logprobs.parquet", LOGPROBS)
    key = lambda t: dict(zip(zip(t.column("prompt_id").to_pylist(), t.column("sample_idx").to_pylist()), t.column("old_logprobs").to_pylist()))
    sep_old, auto_old = key(sep_old), key(auto_old)
    assert sorted(sep_old) == sorted(auto_old)
    for k, v in sep_old.items():
        assert np.allclose(np.asarray(auto_old[k]), np.asarray(v), atol=1e-4), k
    wa, wb = (load_file(next(Path(r.policy_dir(1)).glob("*.safetensors"))) for r in (auto, sep))
    assert wa.keys() == wb.keys()
    moved, apart = movement(load_file(next(Path(auto.policy_dir(0)).glob("*.safetensors"))), wa, wb)
    assert moved > 1e-5 and apart < 1e-2, (moved, apart)
    assert audit_run(auto).ok


PROBE = """
import atexit, sys
def _report():
    print("MODULES " + " ".join(m for m in ("vllm", "deepspeed", "mlflow", "torch", "transformers") if m in sys.modules))
atexit.register(_report)
sys.argv = ["grpo"] + sys.argv[1:]
from stages.cli import main
main()
"""


def _heavy_modules(*args: str) -> set[str]:
    import subprocess
    import sys

    from tests.conftest import REPO

    proc = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("MODULES")][-1]
    return set(line.split()[1:])


def test_commands_without_an_engine_import_neither_vllm_nor_deepspeed(make_run):
    from pipeline.rollout import run_rollout
    from pipeline.run.run import Run

    path = make_run("cold", rollout={"engine": "hf"})
    run_rollout(Run(path), 0)
    assert not {"vllm", "deepspeed", "torch"} & _heavy_modules("--help")
    assert not {"vllm", "deepspeed", "mlflow", "torch"} & _heavy_modules("score", path)  # NumPy group math
    assert (Path(path) / "iter-0000/score/MANIFEST.json").is_file()
    for cmd in ("status", "inspect", "audit"):
        assert not {"vllm", "deepspeed", "torch", "mlflow"} & _heavy_modules(cmd, path), cmd


def test_a_bf16_frozen_lora_base_computes_the_same_bits_under_autocast():
    """The LoRA trainer holds the frozen base's Linear weights in bf16 under bf16 autocast:
    logprobs, entropies and the adapter's gradients are those of the fp32-held base, exactly."""
    from peft import get_peft_model

    from pipeline.config.train import LoraSpec
    from pipeline.run import lora

    def lora_model(seed: int):
        torch.manual_seed(seed)
        model = get_peft_model(_model(seed), lora.peft_config(LoraSpec(r=4)))
        with torch.no_grad():  # a non-zero adapter, so its path counts in the output
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
        return model

    batch, cast = _batch(), {}

    def bf16_base(model):
        cast["n"] = lora.frozen_linears_to_bf16(model)
        cast["dtypes"] = {n: p.dtype for n, p in model.named_parameters()}
        return token_logprobs(model, batch, 0.7, with_entropy=True, precision="bf16")

    outs, grads = _outputs_and_grads(
        (lambda m: token_logprobs(m, batch, 0.7, with_entropy=True, precision="bf16"), bf16_base), seed=0, make_model=lora_model)
    (lp0, e0), (lp1, e1) = outs
    g0, g1 = grads
    dt1 = cast["dtypes"]
    assert cast["n"] == 2 * 7  # q, k, v, o, gate, up, down of both layers
    assert dt1["base_model.model.model.embed_tokens.weight"] == torch.float32  # the tied LM head too
    assert all(d == torch.bfloat16 for n, d in dt1.items() if "base_layer.weight" in n)
    assert all(d == torch.float32 for n, d in dt1.items() if "lora_" in n or "norm" in n)
    assert torch.equal(lp0, lp1) and torch.equal(e0, e1)
    assert g0.keys() == g1.keys() and len(g0) == 4 * 7
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name


_FAMILY = {"Llama": "llama", "Mistral": "mistral", "Mixtral": "mixtral", "Qwen2": "qwen2", "Qwen2Moe": "qwen2_moe",
           "Qwen3": "qwen3", "Phi3": "phi3", "Granite": "granite", "SmolLM3": "smollm3", "DeepseekV3": "deepseek_v3"}


def test_every_class_the_lean_forwards_patch_has_llamas_forward_in_this_transformers():
    import importlib
    import inspect

    from pipeline.models import fused

    def forward_of(name: str, suffix: str):
        family = _FAMILY[name.removesuffix(suffix)]
        return inspect.getsource(getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name).forward)

    for names, suffix in ((fused.RMS_NORMS, "RMSNorm"), (fused.GATED_MLPS, "MLP")):
        assert "Llama" + suffix in names
        for name in names:
            assert forward_of(name, suffix) == forward_of("Llama" + suffix, suffix), name


def _lean_model(seed: int):
    from pipeline.models import fused

    model = _model(seed)
    assert fused.lean_activations(model) == 2 * 2 + 1 + 2  # two norms and an MLP per layer, the final norm
    assert fused.lean_activations(model) == 0  # patching twice changes nothing
    return model


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_lean_activations_keep_hfs_forward_exactly_and_its_gradients(precision):
    """The lean RMSNorm and SwiGLU give HF's logprobs bit for bit; their fp32 backward gives HF's
    fp32 gradients, and under bf16 gradients no further from the fp32 ones than HF's own bf16."""
    batch = _batch()
    run = lambda prec: (lambda m: token_logprobs(m, batch, 0.7, with_entropy=True, precision=prec))
    outs, grads = _outputs_and_grads((run(precision), run(precision)), seed=0)
    lean_outs, lean_grads = _outputs_and_grads((run(precision),), seed=0, make_model=_lean_model)
    (lp, e), (lp_lean, e_lean) = outs[0], lean_outs[0]
    assert torch.equal(lp, lp_lean) and torch.equal(e, e_lean)
    assert torch.equal(outs[1][0], lp)  # HF itself is deterministic here, so equality above means something
    if precision == "fp32":
        for name, g in grads[0].items():
            assert torch.allclose(g, lean_grads[0][name], atol=1e-6, rtol=1e-5), name
        return
    ref = _outputs_and_grads((run("fp32"),), seed=0)[1][0]
    dist = lambda gs: sum(((gs[n] - ref[n]).norm() / ref[n].norm()).item() for n in ref) / len(ref)
    assert 0 < dist(lean_grads[0]) <= 1.05 * dist(grads[0])
    assert any(not torch.equal(grads[0][n], lean_grads[0][n]) for n in ref)  # the lean backward did run


def test_lean_activations_keep_less_for_the_backward():
    batch = _batch()

    def saved_bytes(model) -> int:
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen: dict[int, int] = {}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                seen[ptr] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            token_logprobs(model, batch, 0.7, precision="bf16")
        return sum(seen.values())

    hf, lean = saved_bytes(_model(0)), saved_bytes(_lean_model(0))
    assert lean < 0.85 * hf, (lean, hf)


def test_gradient_checkpointing_recomputes_each_layer_and_keeps_logprobs_and_gradients():
    """HF's non-reentrant checkpointing with the lean forwards: every decoder layer runs again in
    the backward, and the logprobs and gradients are those of the plain forward (rows not sharing
    their prompt, as the trainer runs them then)."""
    prompts = [[5, 6, 7], [5, 6, 7], [9, 8, 7, 6, 5]]
    batch = Batch.build(prompts, [[11, 12, 13, 14], [21, 22], [31, 32, 33]], share_prompts=False)
    calls = []

    def checkpointed(seed: int):
        model = _lean_model(seed)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # HF checkpoints only in training mode
        for layer in model.model.layers:
            layer.register_forward_pre_hook(lambda *_: calls.append(1))  # a recompute stops early: no post hook
        return model

    run = lambda m: token_logprobs(m, batch, 0.7, with_entropy=True)
    (plain,), (g_plain,) = _outputs_and_grads((run,), seed=3, make_model=_lean_model)
    calls.clear()
    (ckpt,), (g_ckpt,) = _outputs_and_grads((run,), seed=3, make_model=checkpointed)
    assert len(calls) == 2 * 2  # two layers, each in the forward and again in the backward
    assert torch.equal(plain[0], ckpt[0]) and torch.equal(plain[1], ckpt[1])
    assert g_plain.keys() == g_ckpt.keys()
    for name in g_plain:
        assert torch.allclose(g_plain[name], g_ckpt[name], atol=1e-6, rtol=1e-5), name


def test_budget_without_shared_prompts_counts_each_rows_prompt():
    prompts, comps = [[1] * 10] * 4, [[2] * 5] * 4  # one prompt for four rows
    assert tokens.shared_budget_batches(prompts, comps, 30) == [[0, 1, 2, 3]]  # 10 + 4 x 5
    assert tokens.shared_budget_batches(prompts, comps, 30, shared=False) == [[0, 1], [2, 3]]  # 2 x 15 each


LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def test_an_update_with_gradient_checkpointing_writes_the_policy_of_one_without(make_run):
    from safetensors.torch import load_file

    from pipeline.logprobs import run_logprobs
    from pipeline.rollout import run_rollout
    from pipeline.score import run_score
    from pipeline.run.run import Run
    from pipeline.update.publish import run_update
    from schemas.artifacts import UPDATE_METRICS

    launcher = {k: os.environ.get(k) for k in LAUNCHER}
    train = {"mini_batch_size": 8, "grad_accum": 1, "precision": "fp32", "lr": 1e-3, "update_token_budget": 64}
    runs = {gc: Run(make_run(f"gc-{gc}", rollout={"engine": "hf"}, train={**train, "gradient_checkpointing": gc})) for gc in (False, True)}
    steps, trainers = {}, {}
    for gc, run in runs.items():
        run_rollout(run, 0)
        run_score(run, 0)
        run_logprobs(run, 0)
        _, trainers[gc] = run_update(run, 0)
        assert {k: os.environ.get(k) for k in LAUNCHER} == launcher  # the group exists; its variables are gone
        steps[gc] = run.store.read_table("iter-0000/update/metrics.parquet", UPDATE_METRICS).to_pylist()
    assert trainers[True].engine.module.is_gradient_checkpointing and not trainers[False].engine.module.is_gradient_checkpointing
    # padded (train.packing off, the default), a checkpointed update runs each prompt once per row:
    # HF's checkpointed layers cannot write the shared prompt's KV cache (packed, it is shared: test_packing)
    assert not trainers[True].share_prompts and trainers[False].share_prompts
    assert len(steps[True]) == len(steps[False]) == 2  # 4 prompts x G=4 in mini-batches of 8
    for a, b in zip(steps[False], steps[True]):
        for key in ("loss/policy", "ratio/mean", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    w0, wa, wb = (load_file(next(Path(p).glob("*.safetensors"))) for p in
                  (runs[False].policy_dir(0), runs[False].policy_dir(1), runs[True].policy_dir(1)))
    moved, apart = movement(w0, wa, wb)
    assert moved > 1e-5 and apart < 1e-3, (moved, apart)
    for t in trainers.values():
        t.close()
    assert {k: os.environ.get(k) for k in LAUNCHER} == launcher
