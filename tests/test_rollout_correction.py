"""`loss.rollout_correction` (w = pi_old / pi_sampler on the policy term, TRL 1.16's
vllm_importance_sampling_*): golden values per mode (arithmetic in the comments), on single
completions and on episode rows whose completion_mask hides tool tokens; the drift a mismatched
sampler causes and the correction removes; the pitfalls (temperature, truncated sampling,
sequence sum vs mean, masked tokens and the denominator); the config and its old runs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import yaml
from conftest import grpo

from pipeline import config as config_mod
from pipeline.objective.loss import policy_loss
from pipeline.config.loss import LossConfig
from pipeline.config.loss import RolloutCorrection
from pipeline.errors import GRPOError
from pipeline.objective.correction import combine, correction_weights

MINIMAL = {"model": "m", "data": {"train": "t.jsonl"}, "rewards": [{"fn": "correct"}]}
LN = math.log


def close(actual, expected, atol=1e-6):
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert torch.allclose(torch.as_tensor(actual).double(), expected, atol=atol, rtol=0), (actual, expected)


def rc(mode, **kw) -> RolloutCorrection:
    return RolloutCorrection(mode=mode, **kw)


# one completion of 3 tokens whose old - sampler log-ratios are (ln 2, ln 0.25, ln 5): w = (2, 0.25, 5)
OLD = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
SAMPLER = OLD - torch.tensor([[LN(2), LN(0.25), LN(5)]], dtype=torch.float64)
ONES = torch.ones(1, 3)


@pytest.mark.parametrize("mode, kw, weights, frac", [
    # token_truncate, cap 3: (2, 0.25, min(5, 3) = 3); one token of three cut
    ("token_truncate", {}, [2, 0.25, 3], 1 / 3),
    # lower 0.5 raises 0.25 to 0.5: (2, 0.5, 3); two cut
    ("token_truncate", {"lower": 0.5}, [2, 0.5, 3], 2 / 3),
    # token_mask, cap 3: 5 > 3 -> 0: (2, 0.25, 0)
    ("token_mask", {}, [2, 0.25, 0], 1 / 3),
    # lower 0.5: 0.25 < 0.5 -> 0 as well: (2, 0, 0)
    ("token_mask", {"lower": 0.5}, [2, 0, 0], 2 / 3),
    # sequence (sum, as TRL 1.16): ln 2 + ln 0.25 + ln 5 = ln 2.5 -> w = 2.5 on every token, inside cap 3
    ("sequence_truncate", {}, [2.5] * 3, 0.0),
    ("sequence_mask", {}, [2.5] * 3, 0.0),
    # cap 2: truncated to 2 / masked to 0, all three tokens cut
    ("sequence_truncate", {"cap": 2.0}, [2.0] * 3, 1.0),
    ("sequence_mask", {"cap": 2.0}, [0.0] * 3, 1.0),
    # mean: (ln 2.5) / 3 -> 2.5^(1/3) = 1.357209
    ("sequence_mask", {"sequence_log_ratio": "mean"}, [1.357209] * 3, 0.0),
])
def test_weights_and_metrics_of_each_mode_on_one_completion(mode, kw, weights, frac):
    w, metrics = correction_weights(OLD, SAMPLER, ONES, rc(mode, **kw))
    close(w, [weights])
    assert metrics["rollout_correction/clipped_frac"] == pytest.approx(frac)
    assert metrics["rollout_correction/ratio_mean"] == pytest.approx(sum(weights) / 3, abs=1e-6)
    assert metrics["rollout_correction/ratio_min"] == pytest.approx(min(weights), abs=1e-6)
    assert metrics["rollout_correction/ratio_max"] == pytest.approx(max(weights), abs=1e-6)


def test_the_weight_multiplies_the_policy_term_detached():
    # ratio 1 (logp = old), A = +1: the grpo per-token loss is -r A = -1, times w, mean over 3 tokens.
    # token_truncate cap 3, w = (2, 0.25, 3): loss = -(2 + 0.25 + 3) / 3 = -1.75; d loss / d logp_t = -w_t / 3
    logp = OLD.clone().requires_grad_()
    loss, metrics = policy_loss(logp, OLD, torch.tensor([1.0], dtype=torch.float64), ONES,
                                LossConfig(rollout_correction=rc("token_truncate")), sampler_logprobs=SAMPLER)
    close(loss, -1.75)
    loss.backward()
    close(logp.grad, [[-2 / 3, -0.25 / 3, -1.0]])
    assert metrics["loss/policy"] == pytest.approx(-1.75) and metrics["ratio/mean"] == pytest.approx(1.0)
    # mode none, or no sampler logprobs (the old policy sampled): the loss of before, -1
    for cfg, sampler in ((LossConfig(rollout_correction=rc("none")), SAMPLER), (LossConfig(), None)):
        loss, metrics = policy_loss(OLD, OLD, torch.tensor([1.0], dtype=torch.float64), ONES, cfg, sampler_logprobs=sampler)
        close(loss, -1.0)
        assert not any(k.startswith("rollout_correction/") for k in metrics)


def test_reinforce_and_kl_under_the_weight():
    # reinforce: -A w logp summed per sequence: A = 1, logp = (-1, -2, -0.5), w = (2, 0.25, 3)
    #   -> -(2 * -1 + 0.25 * -2 + 3 * -0.5) = 2 + 0.5 + 1.5 = 4.0
    cfg = LossConfig(type="reinforce", rollout_correction=rc("token_truncate"))
    loss, _ = policy_loss(OLD, OLD, torch.tensor([1.0], dtype=torch.float64), ONES, cfg, sampler_logprobs=SAMPLER)
    close(loss, 4.0)
    # the KL term is not weighted (TRL adds it after the weight): token_mask, w = (2, 0.25, 0), A = 0 so the
    # policy term is 0; k1 with ref = logp - 0.1 -> kl = 0.1 per token, beta 0.5 -> loss 0.05 even on the masked token
    cfg = LossConfig(kl_coef=0.5, kl_estimator="k1", rollout_correction=rc("token_mask"))
    loss, metrics = policy_loss(OLD, OLD, torch.tensor([0.0], dtype=torch.float64), ONES, cfg,
                                ref_logprobs=OLD - 0.1, sampler_logprobs=SAMPLER)
    close(loss, 0.05)
    assert metrics["kl/mean"] == pytest.approx(0.1)


# an episode row: 5 tokens, the model sampled positions 0, 2, 3 (the same log-ratios as OLD / SAMPLER),
# a tool result sits at 1 and 4: its sampler logprob is the rollout's 0.0, its old logprob a real one
EP_MASK = torch.tensor([[1, 0, 1, 1, 0]])
EP_OLD = torch.tensor([[-1.0, -3.0, -2.0, -0.5, -7.0]], dtype=torch.float64)
EP_SAMPLER = torch.tensor([[-1.0 - LN(2), 0.0, -2.0 - LN(0.25), -0.5 - LN(5), 0.0]], dtype=torch.float64)


@pytest.mark.parametrize("mode, kw", [("token_truncate", {}), ("token_mask", {"lower": 0.5}), ("sequence_truncate", {"cap": 2.0}),
                                      ("sequence_mask", {}), ("sequence_mask", {"sequence_log_ratio": "mean"})])
def test_an_episode_row_weighs_its_model_tokens_only(mode, kw):
    # the tool tokens' log-ratios (-3 - 0 and -7 - 0) would drag a sequence sum to ln 2.5 - 10; they count nowhere,
    # so the model tokens get exactly the single completion's weights and the tool tokens 0
    w, metrics = correction_weights(EP_OLD, EP_SAMPLER, EP_MASK, rc(mode, **kw))
    single, single_metrics = correction_weights(OLD, SAMPLER, ONES, rc(mode, **kw))
    close(w[0, [0, 2, 3]], single[0])
    assert w[0, 1] == 0 and w[0, 4] == 0
    assert metrics == pytest.approx(single_metrics)
    # garbage where the mask is 0 (NaN, 1e30) changes nothing
    old, sampler = EP_OLD.clone(), EP_SAMPLER.clone()
    old[0, 1], sampler[0, 4] = float("nan"), 1e30
    w2, metrics2 = correction_weights(old, sampler, EP_MASK, rc(mode, **kw))
    assert torch.equal(w2, w) and metrics2 == metrics


def test_pitfall_masked_weights_stay_in_the_denominator_but_masked_tokens_do_not():
    # (d, slime PR #657) a token the episode masked (completion_mask 0) leaves the denominator; a token the
    # correction masks (w = 0) stays in it, as TRL's IcePop / MIS: the weight is 0, the completion no shorter.
    # ratio 1, A = 1, token_mask cap 3 on w = (2, 0.25, 5): per-token loss -(2, 0.25, 0)
    #   grpo: -(2 + 0.25 + 0) / 3 = -0.75          (not / 2 = -1.125)
    #   bnpo: the same over the 3 tokens = -0.75
    # the third token masked by the episode instead: grpo and bnpo -(2 + 0.25) / 2 = -1.125 (not / 3)
    adv = torch.tensor([1.0], dtype=torch.float64)
    for kind in ("grpo", "bnpo"):
        cfg = LossConfig(type=kind, rollout_correction=rc("token_mask"))
        close(policy_loss(OLD, OLD, adv, ONES, cfg, sampler_logprobs=SAMPLER)[0], -0.75)
        cfg = LossConfig(type=kind, rollout_correction=rc("token_truncate", cap=1e6))  # w = (2, 0.25, 5): nothing cut
        close(policy_loss(OLD, OLD, adv, torch.tensor([[1, 1, 0]]), cfg, sampler_logprobs=SAMPLER)[0], -1.125)


def test_pitfall_sequence_ratio_is_summed_as_trl_and_averaged_only_on_request():
    # (c, TRL PR #5815) TRL 1.16 keeps the sum: exp(sum of log-ratios) is the completion's likelihood ratio
    # pi_old(y) / pi_sampler(y), the product of the token weights; the PR's mean (rejected upstream) is the
    # per-token geometric mean, which does not grow with length. 300 model tokens, each log-ratio 0.005:
    #   sum:  exp(1.5) = 4.481689 > cap 3 -> sequence_mask drops the completion, sequence_truncate gives 3
    #   mean: exp(0.005) = 1.005013 -> kept
    # a tool token in the middle (log-ratio 9, mask 0) is in neither the sum nor the mean's count
    T = 301
    old = torch.full((1, T), -1.0, dtype=torch.float64)
    sampler = old - 0.005
    sampler[0, 150] = old[0, 150] - 9.0
    mask = torch.ones(1, T)
    mask[0, 150] = 0
    assert RolloutCorrection().sequence_log_ratio == "sum"
    token, _ = correction_weights(old, sampler, mask, rc("token_truncate", cap=1e6))
    product = torch.prod(token[mask.bool()])
    w, _ = correction_weights(old, sampler, mask, rc("sequence_truncate", cap=1e6))
    close(w[0, 0], 4.481689)
    close(w[0, 0], product, atol=1e-9)
    w, metrics = correction_weights(old, sampler, mask, rc("sequence_mask"))
    assert float(w.abs().sum()) == 0.0 and metrics["rollout_correction/clipped_frac"] == 1.0
    close(correction_weights(old, sampler, mask, rc("sequence_truncate"))[0][0, 0], 3.0)
    w, metrics = correction_weights(old, sampler, mask, rc("sequence_mask", sequence_log_ratio="mean"))
    close(w[0, 0], 1.005013)
    assert metrics["rollout_correction/clipped_frac"] == 0.0


def test_pitfall_truncated_sampling_biases_the_weight_so_init_refuses_it(tmp_path):
    # (b, TRL issue #6789) vLLM's processed_logprobs are of the distribution it sampled: truncated by top_p
    # and renormalised over the S of the mass it kept. The trainer's are of the whole distribution, so for
    # every kept token log w = log p - log(p / S) = log S: the weight measures the truncation, not the engines.
    # probabilities (0.5, 0.3, 0.15, 0.05), top_p 0.8 keeps the first two: S = 0.8, w = 0.8 on each
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    kept = torch.cumsum(p, 0) - p < 0.8  # vLLM's rule: a token stays while the mass before it is < top_p
    q = torch.where(kept, p, 0.0) / p[kept].sum()
    close((p.log() - q.log())[kept], [LN(0.8)] * 2)
    # so the correction refuses truncated sampling, at `grpo init` with one line, before anything is written
    for key, value in (("top_p", 0.8), ("top_k", 20), ("min_p", 0.05)):
        with pytest.raises(GRPOError, match="needs untruncated sampling .*set loss.rollout_correction.mode none"):
            config_mod.resolve(MINIMAL, [f"rollout.{key}={value}"])
        cfg = config_mod.resolve(MINIMAL, [f"rollout.{key}={value}", "loss.rollout_correction.mode=none"])
        assert cfg.loss.rollout_correction.mode == "none"
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({**MINIMAL, "rollout": {"top_p": 0.8}}))
    proc = grpo("init", str(tmp_path / "run"), "--config", str(path), check=False)
    assert proc.returncode != 0 and not (tmp_path / "run").exists()
    assert "loss.rollout_correction.mode sequence_mask needs untruncated sampling" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_pitfall_logprobs_are_of_the_logits_divided_by_the_temperature():
    # (a, TRL #4159) the engine samples from softmax(logits / T) and reports those logprobs; the trainer's
    # old and current logprobs must be the same: log_softmax(logits / T), whichever path computes them
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.models.tokens import Batch, token_logprobs

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)).eval()
    prompts, comps = [[1, 2, 3], [1, 2, 3], [4, 5]], [[6, 7, 8, 9], [10, 11], [12, 13, 14]]
    for T in (0.7, 1.0, 1.6):
        expected = []
        with torch.no_grad():
            for p, c in zip(prompts, comps):
                logits = model(torch.tensor([p + c])).logits[0, len(p) - 1 : -1]  # [len(c), V] the logits predicting c
                expected.append(torch.log_softmax(logits.double() / T, -1)[torch.arange(len(c)), torch.tensor(c)])
            for share in (False, True):
                batch = Batch.build(prompts, comps, share_prompts=share)
                logp, _ = token_logprobs(model, batch, T)
                for i, e in enumerate(expected):
                    close(logp[i, : len(e)], e, atol=1e-5)
        if T != 1.0:  # the check bites: without the division the logprobs differ
            with torch.no_grad():
                plain, _ = token_logprobs(model, Batch.build(prompts, comps), 1.0)
            assert (plain[0, :4].double() - expected[0]).abs().max() > 1e-2


def test_drift_a_mismatched_sampler_biases_the_gradient_and_the_correction_removes_it():
    # The conformance suite's stale-sampler problem (pipeline/conformance/loss.py): 3 categorical positions
    # over 4 tokens, 20000 sequences from a perturbed sampler, the exact on-policy gradient g_on by
    # enumeration. Uncorrected the samples estimate E_sampler instead (drift); with w = pi_old(y) /
    # pi_sampler(y) the estimate is unbiased (the cap 3 of TRL's default never binds here).
    from pipeline.conformance.loss import stale_sampler_problem

    theta, lp_sampler, pos, ys, adv, g_on = stale_sampler_problem()
    N, T = ys.shape

    def gradient(mode: str) -> torch.Tensor:
        th = theta.clone().requires_grad_()
        logp = torch.log_softmax(th, -1)[pos, ys]  # [N, T]
        loss, _ = policy_loss(logp, logp.detach(), adv, torch.ones(N, T),
                              LossConfig(rollout_correction=rc(mode)), sampler_logprobs=lp_sampler[pos, ys])
        loss.backward()
        return th.grad

    def error(grad):
        return float((grad - g_on).norm() / g_on.norm())

    drift, corrected = error(gradient("none")), error(gradient("sequence_mask"))
    # measured: 0.283 uncorrected, 0.035 corrected (the Monte Carlo floor at N = 20000)
    assert drift > 0.2 and corrected < 0.08 and corrected < drift / 4
    assert error(gradient("sequence_truncate")) < 0.08


def test_combine_takes_min_and_max_and_skips_pieces_without_tokens():
    acc: dict[str, float] = {}
    for v, w in ((0.5, 0.25), (float("nan"), 0.0), (2.0, 0.75)):
        for key in ("rollout_correction/ratio_mean", "rollout_correction/ratio_min", "rollout_correction/ratio_max"):
            combine(acc, key, 0.0 if math.isnan(v) and key.endswith("_mean") else v, w)
    # the mean is weighted: 0.5 * 0.25 + 0 + 2.0 * 0.75 = 1.625; min 0.5, max 2.0
    assert acc == {"rollout_correction/ratio_mean": 1.625, "rollout_correction/ratio_min": 0.5, "rollout_correction/ratio_max": 2.0}


# --------------------------------------------------------------------------- config and old runs


def test_a_new_run_gets_trl_1_16_default_written_into_its_config():
    # TRL 1.16: vllm_importance_sampling_correction=True, mode "sequence_mask", clip_max 3.0, clip_min None
    cfg = config_mod.resolve(MINIMAL)
    assert cfg.loss.rollout_correction == RolloutCorrection(mode="sequence_mask", cap=3.0, lower=None, sequence_log_ratio="sum")
    stored = yaml.safe_load(config_mod.to_yaml(cfg))
    assert stored["loss"]["rollout_correction"] == {"mode": "sequence_mask", "cap": 3.0, "lower": None, "sequence_log_ratio": "sum"}
    assert config_mod.from_yaml_text(config_mod.to_yaml(cfg), "run").loss.rollout_correction.mode == "sequence_mask"


def test_a_run_made_before_the_option_keeps_its_behaviour_and_hash(tmp_path):
    """Its config.yaml has no loss.rollout_correction: it reads as mode none, whose canonical form
    leaves the key out, so the hash is the one its manifests were written with."""
    import hashlib
    import json

    from pipeline.run.run import Run

    tree = config_mod.resolve(MINIMAL).model_dump(mode="json")
    for *path, key in config_mod.ADDED_OPTIONS:  # as written before every added option
        section = tree
        for part in path:  # an option inside a section already gone (rollout.agent.verifiers) is gone with it
            section = section.get(part) if isinstance(section, dict) else None
        if isinstance(section, dict):
            del section[key]
    for entry in tree["rewards"]:  # and in every reward entry (rewards[].range)
        for key in config_mod.ADDED_REWARD_OPTIONS:
            del entry[key]
    old_hash = hashlib.sha256(json.dumps(tree, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
    run = Run(str(tmp_path))
    assert run.cfg.loss.rollout_correction.mode == "none"
    # in the form its manifests were written with (train.state_every hashed: Run.legacy_hash reads that
    # form off a run's first manifest; this one has none, so it is asked for here)
    assert config_mod.config_hash(run.cfg, True) == old_hash
    # the same run written today (the key present, at none; the trainer state after every update and
    # torch's attention kernel in the update, as then) has the same hash; any correction changes it
    now = config_mod.resolve(tree, ["loss.rollout_correction.mode=none", "train.state_every=1", "train.cpu_attention=sdpa"])
    assert config_mod.config_hash(now, True) == old_hash
    assert config_mod.config_hash(config_mod.resolve(tree), True) != old_hash


@pytest.mark.parametrize("value, message", [("1.0", "cap: Input should be greater than 1"), ("0.5", "cap: Input should be greater than 1")])
def test_a_cap_of_at_most_one_is_a_one_line_error_at_init(tmp_path, value, message):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(MINIMAL))
    proc = grpo("init", str(tmp_path / "run"), "--config", str(path), "--set", f"loss.rollout_correction.cap={value}", check=False)
    assert proc.returncode != 0 and not (tmp_path / "run").exists()
    assert f"loss.rollout_correction.{message}" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


# --------------------------------------------------------------------------- what an iteration reports


def _rows(old, sampler, masks):
    import polars as pl

    return pl.DataFrame({"old_logprobs": old, "sampler_logprobs": sampler, "completion_mask": masks},
                        schema={"old_logprobs": pl.List(pl.Float32), "sampler_logprobs": pl.List(pl.Float32),
                                "completion_mask": pl.List(pl.Int8)})


def test_an_iteration_reports_the_log_weights_quantiles_and_the_share_the_loss_cuts():
    from pipeline.objective.correction import iteration_stats

    # four completions of 3 model tokens, old - sampler per token:
    #   a (0.5, 0.5, 0.5): log W = 1.5 > ln 3 = 1.0986     b (0.1, -0.1, 0): 0
    #   c (-0.4, -0.4, -0.4): -1.2                          d (1.2, -0.1, -0.1): 1.0, its first token alone > ln 3
    # e: a tool result at position 1 (mask 0; old - sampler there 9 would count otherwise): (0.1, ., 0.1) -> 0.2
    # f: no old logprobs (not yet computed): left out
    d = [[0.5, 0.5, 0.5], [0.1, -0.1, 0.0], [-0.4, -0.4, -0.4], [1.2, -0.1, -0.1], [0.1, 9.0, 0.1]]
    old = [[-1.0, -2.0, -3.0]] * 5 + [None]
    sampler = [[o - x for o, x in zip(old[0], row)] for row in d] + [[-1.0, -1.0, -1.0]]
    masks = [None, None, None, None, [1, 0, 1], None]
    rows = _rows(old, sampler, masks)
    logs = [1.5, 0.0, -1.2, 1.0, 0.2]
    expected_q = np.quantile(logs, [0.05, 0.5, 0.95])  # -1.2 + 0.2 * 1.2 = -0.96, 0.2, 1.5 - 0.2 * 0.5 = 1.4
    close(expected_q, [-0.96, 0.2, 1.4])
    for mode, kw, share in (
        ("sequence_mask", {}, 1 / 5),  # a only
        ("sequence_truncate", {"lower": 0.5}, 2 / 5),  # a, and c: W = e^-1.2 = 0.30 < 0.5
        ("token_truncate", {}, 1 / 5),  # d's first token: e^1.2 = 3.32 > 3
        ("token_mask", {"lower": 0.68}, 2 / 5),  # d, and c: e^-0.4 = 0.670 < 0.68 on each token
        ("none", {}, float("nan")),
    ):
        stats = iteration_stats(rows, rc(mode, **kw))
        close([stats[f"rollout_correction/log_ratio_p{p}"] for p in ("05", "50", "95")], expected_q, atol=1e-5)
        got = stats["rollout_correction/clipped_seq_frac"]
        assert (math.isnan(got) and math.isnan(share)) or got == pytest.approx(share), (mode, got)
        if mode != "none":  # the same completions as the loss's own weights cut
            sel = [0, 1, 2, 3, 4]
            t = lambda rows_: torch.tensor([rows_[i] for i in sel], dtype=torch.float64)  # noqa: E731
            mask = torch.tensor([[1, 1, 1]] * 4 + [[1, 0, 1]])
            w, _ = correction_weights(t(old), t(sampler), mask, rc(mode, **kw))
            raw = torch.exp(torch.tensor(d, dtype=torch.float64))
            if mode.startswith("sequence"):
                raw = torch.exp(torch.tensor(logs, dtype=torch.float64)).unsqueeze(1).expand(5, 3)
            changed = ((w - raw).abs() > 1e-9) & mask.bool()
            assert changed.any(dim=1).double().mean() == pytest.approx(share)
    # the mean per token with `sequence_log_ratio: mean`: (0.5, 0, -0.4, 1/3, 0.1); none above ln 3
    stats = iteration_stats(rows, rc("sequence_mask", sequence_log_ratio="mean"))
    close(stats["rollout_correction/log_ratio_p50"], 0.1, atol=1e-6)
    assert stats["rollout_correction/clipped_seq_frac"] == 0.0
    assert iteration_stats(rows.head(0), rc("sequence_mask")) == {}


def test_a_large_share_cut_is_a_warning_naming_the_iteration_and_the_gap():
    from pipeline.report.diagnostics import diagnose

    rows = [{"iteration": 0, "rollout_correction/clipped_seq_frac": 0.1},
            {"iteration": 1, "rollout_correction/clipped_seq_frac": 0.35, "logprobs/sampler_gap_mean": 0.041},
            {"iteration": 2, "rollout_correction/clipped_seq_frac": float("nan")}]  # mode none
    (finding,) = diagnose(rows)
    assert finding.iteration == 1 and finding.metric == "rollout_correction/clipped_seq_frac"
    assert str(finding) == ("iteration 1: rollout_correction/clipped_seq_frac = 0.35: loss.rollout_correction truncated or "
                            "masked the weight of 35% of completions (sampler gap 0.041 a token): the sampler is far from "
                            "the trainer's policy; see docs/off-policy.md")


def test_the_default_leaves_bf16_rounding_alone_and_reweighs_a_perturbed_sampler():
    """A policy of 32 positions over 64 tokens (logits ~ 6 N(0, 1)), the trainer at temperature 0.8.
    A sampler that computes the same policy with its logits rounded to bf16 (what vLLM's bf16 LM head
    does, docs/off-policy.md) cuts no completion and leaves every weight near 1; a perturbed one (its
    temperature 1.0, as a sampler that missed the change) has its completions reweighed and the
    far ones masked."""
    from pipeline.objective.correction import iteration_stats

    g = torch.Generator().manual_seed(0)
    B, T, V = 512, 32, 64
    z = 6 * torch.randn(B, T, V, generator=g)

    def sample(logits):
        return torch.multinomial(torch.softmax(logits, -1).reshape(-1, V), 1, generator=g).reshape(B, T)

    def lp(logits, y):
        return torch.log_softmax(logits, -1).gather(-1, y[..., None])[..., 0]

    default = RolloutCorrection()
    ones = torch.ones(B, T)
    y = sample(z / 0.8)
    old, rounded = lp(z / 0.8, y), lp(z.bfloat16().float() / 0.8, y)
    w, metrics = correction_weights(old, rounded, ones, default)
    # measured: |old - sampler| 0.0075 a token on average, the completion's log W spread 0.075
    assert metrics["rollout_correction/clipped_frac"] == 0.0
    assert 0.75 < metrics["rollout_correction/ratio_min"] and metrics["rollout_correction/ratio_max"] < 1.35
    stats = iteration_stats(_rows(old.tolist(), rounded.tolist(), [None] * B), default)
    assert stats["rollout_correction/clipped_seq_frac"] == 0.0
    assert -0.2 < stats["rollout_correction/log_ratio_p05"] and stats["rollout_correction/log_ratio_p95"] < 0.2

    y = sample(z / 1.0)
    old, hot = lp(z / 0.8, y), lp(z / 1.0, y)
    w, metrics = correction_weights(old, hot, ones, default)
    stats = iteration_stats(_rows(old.tolist(), hot.tolist(), [None] * B), default)
    # measured with sequence_mask, cap 3: 6.8 % of completions above the cap, masked; the mean weight 0.67
    assert stats["rollout_correction/clipped_seq_frac"] == pytest.approx(metrics["rollout_correction/clipped_frac"])
    assert 0.04 < metrics["rollout_correction/clipped_frac"] and metrics["rollout_correction/ratio_mean"] < 0.8
    assert stats["rollout_correction/log_ratio_p05"] < -2.0


def test_status_shows_the_share_cut_and_warns_when_it_is_large(make_run):
    """The constructed run of test_inspect (6 completions, sampler logprobs -0.1 a token) with a
    logprobs stage whose old logprobs lie 0.3 a token above the sampler's on the first two: their
    log W = 4 x 0.3 = 1.2 and 6 x 0.3 = 1.8, above ln 3 = 1.0986, so TRL's default masks 2 of 6."""
    import json

    import pyarrow as pa
    from test_inspect import LENGTHS, _write_stage, constructed_run

    from schemas.artifacts import LOGPROBS

    run = constructed_run(make_run)
    shift = [0.3, 0.3, 0, 0, 0, 0]
    old = [[-0.1 + s] * n for s, n in zip(shift, LENGTHS)]
    _write_stage(run, 0, "logprobs", LOGPROBS, pa.table({
        "prompt_id": [10, 10, 10, 20, 20, 20], "sample_idx": [0, 1, 2, 0, 1, 2],
        "old_logprobs": pa.array(old, pa.list_(pa.float32())), "ref_logprobs": pa.nulls(6, pa.list_(pa.float32())),
        "sampler_gap_mean": pa.array(shift, pa.float32()), "sampler_gap_max": pa.array(shift, pa.float32()),
    }))
    assert run.cfg.loss.rollout_correction.mode == "sequence_mask"
    status = json.loads(grpo("status", run.uri, "--format", "json").stdout)
    row = status["iterations"][0]
    assert row["rollout_correction/clipped_seq_frac"] == pytest.approx(2 / 6)
    # log W = (1.2, 1.8, 0, 0, 0, 0): quantiles 0, 0, 1.8 - 0.25 x 0.6 = 1.65
    assert row["rollout_correction/log_ratio_p50"] == pytest.approx(0.0, abs=1e-6)
    assert row["rollout_correction/log_ratio_p95"] == pytest.approx(1.65, abs=1e-5)
    assert [w["metric"] for w in status["warnings"]] == ["rollout_correction/clipped_seq_frac"]
    table = grpo("status", run.uri).stdout
    assert "cut" in table and "33%" in table
    assert "warning iteration 0: rollout_correction/clipped_seq_frac = 0.333: loss.rollout_correction truncated or masked" in table
