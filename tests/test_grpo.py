"""GRPO math against hand-derived numbers (arithmetic in the comments) and a naive loop."""

import json
import math

import numpy as np
import pytest
import torch

from pipeline.objective.advantages import combine_rewards, group_advantages, group_stats
from pipeline.config.loss import LossConfig
from pipeline.objective.kl import AdaptiveKLController, FixedKLController, make_kl_controller
from pipeline.objective.loss import kl_estimate, kl_penalised_rewards, policy_loss

NAN = float("nan")


def t(*values, dtype=torch.float64):
    return torch.tensor(values, dtype=dtype)


def a(*values, dtype=np.float64):
    """Rewards as the score stage holds them: a NumPy array."""
    return np.array(values, dtype=dtype)


def zeros_exactly(actual, n, dtype=np.float64) -> bool:
    return actual.dtype == dtype and np.array_equal(actual, np.zeros(n, dtype))


def close(actual, expected, atol=1e-6):
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert torch.allclose(torch.as_tensor(actual).double(), expected, atol=atol, rtol=0), (actual, expected)


# --------------------------------------------------------------------------- advantages: seed notes


def test_population_std_matches_the_seed_notes_worked_example():
    # [2, 1, 1]: mean 4/3, deviations (2/3, -1/3, -1/3), population var (4/9 + 1/9 + 1/9) / 3 = 2/9,
    # std sqrt(2)/3 = 0.471405; A = (2/3) / (sqrt(2)/3) = sqrt(2) = 1.414214, (-1/3) / (sqrt(2)/3) = -0.707107
    adv = group_advantages(a(2, 1, 1), 3, std="population", eps=0.0)
    close(adv, [1.414214, -0.707107, -0.707107])


def test_sample_std_matches_torch_and_trl():
    # [2, 1, 1]: sample var (6/9) / 2 = 1/3, std 0.577350; A = (2/3) / 0.577350 = 1.154701, (-1/3) / 0.577350 = -0.577350
    adv = group_advantages(a(2, 1, 1), 3, std="sample", eps=0.0)
    close(adv, [1.154701, -0.577350, -0.577350])
    # [1, 0, 0, 1]: mean 1/2, sample var 4 * (1/4) / 3 = 1/3, std 0.577350; A = +-0.5 / 0.577350 = +-0.866025
    adv = group_advantages(a(1, 0, 0, 1), 4, eps=0.0)
    close(adv, [0.866025, -0.866025, -0.866025, 0.866025])


def test_default_eps_is_added_to_the_std():
    # eps = 1e-4: A = (2/3) / (sqrt(2)/3 + 1e-4) = 0.666667 / 0.471505 = 1.413914
    adv = group_advantages(a(2, 1, 1), 3, std="population")
    close(adv[0], (2 / 3) / (math.sqrt(2) / 3 + 1e-4))
    close(adv[0], 1.413914)


def test_all_equal_group_gets_exactly_zero_advantages():
    # [1, 1, 1] has no spread: no learning signal, exactly 0 (not 0 / eps rounding noise)
    assert zeros_exactly(group_advantages(a(1, 1, 1), 3), 3)
    # float32 0.1 three times: the float mean is not exactly 0.1, yet every scale still gives exact zeros
    rewards = np.full(3, 0.1, dtype=np.float32)
    for scale in ("group", "batch", "none"):
        assert zeros_exactly(group_advantages(rewards, 3, scale=scale), 3, np.float32)
    # two groups: [2, 1, 1] keeps its advantages, [1, 1, 1] stays 0
    adv = group_advantages(a(2, 1, 1, 1, 1, 1), 3, eps=0.0)
    close(adv, [1.154701, -0.577350, -0.577350, 0, 0, 0])
    assert zeros_exactly(adv[3:], 3)


def test_nan_rewards_are_left_out_of_the_statistics_and_get_zero():
    # [2, NaN, 1, 1]: statistics over [2, 1, 1] (sample std 0.577350 as above), the NaN completion gets 0
    # [NaN, 1, NaN, NaN]: one valid reward, nothing to compare -> zeros
    # [NaN, NaN, NaN, NaN]: zeros
    rewards = a(2, NAN, 1, 1, NAN, 1, NAN, NAN, NAN, NAN, NAN, NAN)
    adv = group_advantages(rewards, 4, eps=0.0)
    assert not np.isnan(adv).any()
    close(adv, [1.154701, 0, -0.577350, -0.577350] + [0] * 8)
    assert zeros_exactly(adv[4:], 8)


def test_group_stats_mean_std_and_zero_std_flags():
    # groups [2, NaN, 1, 1] -> mean 4/3, sample std 0.577350; [3, 3, NaN, 3] -> mean 3, std 0, zero_std;
    # [NaN, 5, NaN, NaN] -> mean 5, std 0, zero_std (one reward); all NaN -> mean NaN, std NaN, zero_std
    rewards = a(2, NAN, 1, 1, 3, 3, NAN, 3, NAN, 5, NAN, NAN, NAN, NAN, NAN, NAN)
    mean, std, zero_std = group_stats(rewards, 4)
    close(mean[:3], [4 / 3, 3, 5])
    close(std[:3], [0.577350, 0, 0])
    assert np.isnan(mean[3]) and np.isnan(std[3])
    assert zero_std.tolist() == [False, True, True, True]
    # population std of [2, 1, 1] is sqrt(2)/3 = 0.471405
    _, std, _ = group_stats(a(2, 1, 1), 3, std="population")
    close(std, [0.471405])
    # the dtype follows the rewards
    mean, std, zero_std = group_stats(np.array([1.0, 0.0], np.float32), 2)
    assert mean.dtype == std.dtype == np.float32 and zero_std.dtype == bool


def test_batch_scale_divides_by_the_whole_batch_std():
    # [0, 2 | 2, 4], population: batch mean 2, var (4 + 0 + 0 + 4) / 4 = 2, std sqrt(2);
    # group means 1 and 3 -> centred (-1, 1, -1, 1) -> A = +-1 / sqrt(2) = +-0.707107
    # (group scaling would give +-1: each group's population std is 1)
    adv = group_advantages(a(0, 2, 2, 4), 2, scale="batch", std="population", eps=0.0)
    close(adv, [-0.707107, 0.707107, -0.707107, 0.707107])
    close(group_advantages(a(0, 2, 2, 4), 2, scale="group", std="population", eps=0.0), [-1, 1, -1, 1])
    # add a zero-spread group [5, 5]: batch [0, 2, 2, 4, 5, 5], mean 3, squared deviations 9+1+1+1+4+4 = 20,
    # population var 20/6, std 1.825742; A = +-1 / 1.825742 = +-0.547723 and the [5, 5] group stays 0
    adv = group_advantages(a(0, 2, 2, 4, 5, 5), 2, scale="batch", std="population", eps=0.0)
    close(adv, [-0.547723, 0.547723, -0.547723, 0.547723, 0, 0])


def test_none_scale_only_centres():
    # Dr. GRPO: A = r - mean = (2 - 4/3, 1 - 4/3, 1 - 4/3) = (0.666667, -0.333333, -0.333333)
    close(group_advantages(a(2, 1, 1), 3, scale="none"), [0.666667, -0.333333, -0.333333])


def test_std_floor_clamps_instead_of_adding_eps():
    # [1.0, 1.1]: mean 1.05, sample var 2 * 0.05^2 / 1 = 0.005, std 0.070711 < 0.1 -> divide by 0.1: A = +-0.5
    close(group_advantages(a(1.0, 1.1), 2, std_floor=0.1), [-0.5, 0.5])
    # [2, 1, 1]: std 0.577350 > 0.1 -> unchanged and no eps added: 1.154701, -0.577350
    close(group_advantages(a(2, 1, 1), 3, std_floor=0.1), [1.154701, -0.577350, -0.577350])


def test_batch_renorm_rescales_over_completions_with_signal():
    # groups [2, 1, 1] -> (1.154701, -0.577350, -0.577350); [1, 1, 1] -> zeros; [0, 1, 1] -> (-1.154701, 0.577350, 0.577350)
    # over the 6 completions with signal: mean 0, sample var (2 * 4/3 + 4 * 1/3) / 5 = 0.8, std 0.894427
    # -> (2/sqrt(3)) / (2/sqrt(5)) = sqrt(5/3) = 1.290994 and half of it 0.645497; the [1, 1, 1] group stays 0
    adv = group_advantages(a(2, 1, 1, 1, 1, 1, 0, 1, 1), 3, eps=0.0, batch_renorm=True)
    close(adv, [1.290994, -0.645497, -0.645497, 0, 0, 0, -1.290994, 0.645497, 0.645497])
    assert zeros_exactly(adv[3:6], 3)


def test_advantages_reject_rewards_that_do_not_split_into_groups():
    with pytest.raises(ValueError, match="num_generations=4"):
        group_advantages(a(1, 2, 3), 4)
    with pytest.raises(ValueError, match="scale"):
        group_advantages(a(1, 2), 2, scale="prompt")


# --------------------------------------------------------------------------- rewards


def test_combine_rewards_is_a_weighted_nansum_and_all_nan_rows_stay_nan():
    # weights (1, 2): [1, 0.5] -> 1 + 1 = 2; [NaN, 1] -> 2 (the NaN function does not apply); [NaN, NaN] -> NaN
    total = combine_rewards(a(1, 0.5, NAN, 1, NAN, NAN).reshape(3, 2), a(1, 2))
    close(total[:2], [2, 2])
    assert np.isnan(total[2])
    # the NaN row then gets advantage 0 and is left out of its group's statistics
    adv = group_advantages(np.concatenate([total, a(0)]), 4, eps=0.0)
    # valid rewards [2, 2, 0]: mean 4/3, sample std sqrt((4/9 + 4/9 + 16/9) / 2) = sqrt(4/3) = 1.154701
    # A = (2/3) / 1.154701 = 0.577350, (-4/3) / 1.154701 = -1.154701
    close(adv, [0.577350, 0.577350, 0, -1.154701])


# --------------------------------------------------------------------------- KL


def test_kl_estimators_on_hand_computed_values():
    # logp = -1, ref = -1.5: log r = ref - logp = -0.5; k1 = 0.5, k2 = 0.125, k3 = e^-0.5 + 0.5 - 1 = 0.106531
    # logp = -2, ref = -1:   log r = 1;                 k1 = -1,  k2 = 0.5,   k3 = e - 1 - 1 = 0.718282
    logp, ref = t(-1.0, -2.0), t(-1.5, -1.0)
    close(kl_estimate(logp, ref, "k1"), [0.5, -1.0])
    close(kl_estimate(logp, ref, "k2"), [0.125, 0.5])
    close(kl_estimate(logp, ref, "k3"), [0.106531, 0.718282])
    # equal policies: every estimator is exactly 0
    for estimator in ("k1", "k2", "k3"):
        assert torch.equal(kl_estimate(logp, logp, estimator), torch.zeros(2, dtype=torch.float64))


def test_k3_is_never_negative():
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(10_000, generator=gen) * 5  # float32
    # log-ratios across scales, down to 1e-8 where a naive exp(x) - x - 1 rounds below 0 in float32
    scale = 10.0 ** torch.randint(-8, 1, (10_000,), generator=gen).float()
    ref = logp + torch.randn(10_000, generator=gen) * scale
    assert (kl_estimate(logp, ref, "k3") >= 0).all()
    assert (kl_estimate(logp.double(), ref.double(), "k3") >= 0).all()


def test_kl_penalised_rewards_subtracts_the_summed_k1():
    # sequence 0: k1 = logp - ref = (-1 + 1.5) + (-2 + 1) = -0.5 -> 1 - 0.1 * (-0.5) = 1.05
    # sequence 1: one active token, k1 = -0.5 + 1 = 0.5 -> 2 - 0.1 * 0.5 = 1.95 (padding holds -inf and NaN)
    logp = t(-1.0, -2.0, -0.5, -float("inf")).view(2, 2)
    ref = t(-1.5, -1.0, -1.0, NAN).view(2, 2)
    mask = torch.tensor([[1, 1], [1, 0]])
    close(kl_penalised_rewards(t(1.0, 2.0), logp, ref, mask, 0.1), [1.05, 1.95])


def test_adaptive_kl_controller_two_steps_and_state_round_trip():
    ctl = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10_000)
    # step 1: KL 9: error = clip(9/6 - 1 = 0.5, -0.2, 0.2) = 0.2; coef = 0.1 * (1 + 0.2 * 256 / 10000) = 0.1 * 1.00512 = 0.100512
    assert ctl.update(9.0, n_steps=256) == pytest.approx(0.100512, abs=1e-12)
    # step 2: KL 5.4: error = 5.4/6 - 1 = -0.1; coef = 0.100512 * (1 - 0.1 * 512 / 10000) = 0.100512 * 0.99488 = 0.09999737856
    assert ctl.update(5.4, n_steps=512) == pytest.approx(0.09999737856, abs=1e-12)
    # the state survives JSON and a fresh controller continues identically
    state = json.loads(json.dumps(ctl.state_dict()))
    restored = AdaptiveKLController(init_coef=1.0, target=1.0, horizon=1)
    restored.load_state_dict(state)
    assert restored.state_dict() == ctl.state_dict()
    assert restored.update(7.0, 64) == ctl.update(7.0, 64)
    with pytest.raises(ValueError, match="kind"):
        FixedKLController(0.1).load_state_dict(state)
    with pytest.raises(ValueError, match="non-finite"):
        ctl.update(float("nan"), 1)


def test_fixed_kl_controller_and_factory():
    fixed = make_kl_controller(0.05, target=None, horizon=100)
    assert isinstance(fixed, FixedKLController)
    assert fixed.update(100.0, 1000) == 0.05 and fixed.coef == 0.05
    state = json.loads(json.dumps(fixed.state_dict()))
    other = FixedKLController(0.0)
    other.load_state_dict(state)
    assert other.coef == 0.05
    adaptive = make_kl_controller(0.05, target=6.0, horizon=100)
    assert isinstance(adaptive, AdaptiveKLController) and adaptive.horizon == 100


# --------------------------------------------------------------------------- policy loss: seed notes


def test_reinforce_loss_of_the_seed_notes_worked_example():
    # loss = -(1/3) [(-2.30)(1.41) + (-1.20)(-0.70) + (-1.61)(-0.70)] = -(1/3)(-3.243 + 0.84 + 1.127)
    #      = 1.276 / 3 = 0.425333 (the notes round to 0.425)
    cfg = LossConfig(type="reinforce")
    logp = t(-2.30, -1.20, -1.61).view(3, 1)
    adv = t(1.41, -0.70, -0.70)
    loss, metrics = policy_loss(logp, logp, adv, torch.ones(3, 1), cfg)
    close(loss, 1.276 / 3)
    close(loss, 0.425333)
    # second group: three sequences with logprob -1.39 and advantage 0 add nothing; mean over the 6
    # sequences = 1.276 / 6 = 0.212667 (the notes' 0.2125 halves the rounded 0.425)
    logp6 = torch.cat([logp, torch.full((3, 1), -1.39, dtype=torch.float64)])
    adv6 = torch.cat([adv, torch.zeros(3, dtype=torch.float64)])
    loss6, _ = policy_loss(logp6, logp6, adv6, torch.ones(6, 1), cfg)
    close(loss6, 0.212667)
    assert metrics["clip/ratio_region"] == 0.0 and metrics["loss/policy"] == pytest.approx(0.425333, abs=1e-6)


def test_reinforce_sums_token_logprobs_per_sequence():
    # one sequence of 3 tokens (log p = -0.5 - 1.0 - 0.2 = -1.7) with A = 2, one padded position:
    # loss = -(-1.7 * 2) = 3.4 (a sum over tokens, not a mean)
    logp = t(-0.5, -1.0, -0.2, 7.0).view(1, 4)
    loss, _ = policy_loss(logp, logp, t(2.0), torch.tensor([[1, 1, 1, 0]]), LossConfig(type="reinforce"))
    close(loss, 3.4)


# --------------------------------------------------------------------------- policy loss: clipping


def _single_tokens(new_probs, old_probs, adv):
    logp = torch.tensor(new_probs, dtype=torch.float64).log().view(-1, 1).requires_grad_()
    old = torch.tensor(old_probs, dtype=torch.float64).log().view(-1, 1)
    return logp, old, torch.tensor(adv, dtype=torch.float64), torch.ones_like(old)


def test_clipping_on_the_seed_notes_ratios():
    # pi = 0.9 / pi_old = 0.5 -> ratio 1.8, clip to 1.2; pi = 0.2 / 0.5 -> ratio 0.4, clip to 0.8 (eps 0.2)
    # per sequence l = -min(r A, clip(r) A):
    #   r 1.8, A +1: min(1.8, 1.2) = 1.2 -> l = -1.2, clipped above (no gradient)
    #   r 1.8, A -1: min(-1.8, -1.2) = -1.8 -> l = 1.8, unclipped: dl/dlogp = -A r = 1.8
    #   r 0.4, A +1: min(0.4, 0.8) = 0.4 -> l = -0.4, unclipped: dl/dlogp = -A r = -0.4
    #   r 0.4, A -1: min(-0.4, -0.8) = -0.8 -> l = 0.8, clipped below (no gradient)
    # grpo mean over 4 one-token sequences: (-1.2 + 1.8 - 0.4 + 0.8) / 4 = 0.25; gradients / 4
    logp, old, adv, mask = _single_tokens([0.9, 0.9, 0.2, 0.2], [0.5] * 4, [1, -1, 1, -1])
    loss, metrics = policy_loss(logp, old, adv, mask, LossConfig())
    close(loss, 0.25)
    loss.backward()
    close(logp.grad.flatten(), [0.0, 1.8 / 4, -0.4 / 4, 0.0])
    assert metrics["clip/ratio_high"] == pytest.approx(0.25)  # only (1.8, A > 0)
    assert metrics["clip/ratio_low"] == pytest.approx(0.25)  # only (0.4, A < 0)
    assert metrics["clip/ratio_region"] == pytest.approx(0.5)
    assert metrics["ratio/mean"] == pytest.approx((1.8 + 1.8 + 0.4 + 0.4) / 4)
    assert metrics["loss/policy"] == pytest.approx(0.25) and metrics["loss/total"] == pytest.approx(0.25)


def test_clip_higher_uses_separate_eps():
    # eps_low 0.2, eps_high 0.28: ratio 1.25 with A = 1 is inside [0.8, 1.28] -> l = -1.25, gradient -1.25
    # ratio 0.75 with A = -1 is below 0.8 -> l = -min(-0.75, -0.8) = 0.8, clipped
    logp, old, adv, mask = _single_tokens([0.625, 0.375], [0.5, 0.5], [1, -1])
    loss, metrics = policy_loss(logp, old, adv, mask, LossConfig(clip_eps_low=0.2, clip_eps_high=0.28))
    close(loss, (-1.25 + 0.8) / 2)
    loss.backward()
    close(logp.grad.flatten(), [-1.25 / 2, 0.0])
    assert metrics["clip/ratio_high"] == 0.0 and metrics["clip/ratio_low"] == pytest.approx(0.5)


def test_delta_caps_the_ratio_for_negative_advantages():
    # delta 1.5, eps 0.2:
    #   r 1.8, A -1: min(min(1.8, 1.5) * -1, 1.2 * -1) = -1.5 -> l = 1.5 and no gradient (capped); without delta l = 1.8
    #   r 1.3, A -1: min(-1.3, -1.2) = -1.3 -> l = 1.3, gradient -A r = 1.3
    #   r 1.8, A +1: min(1.5, 1.2) = 1.2 -> l = -1.2, unchanged by delta
    logp, old, adv, mask = _single_tokens([0.9, 0.65, 0.9], [0.5] * 3, [-1, -1, 1])
    loss, _ = policy_loss(logp, old, adv, mask, LossConfig(delta=1.5))
    close(loss, (1.5 + 1.3 - 1.2) / 3)
    loss.backward()
    close(logp.grad.flatten(), [0.0, 1.3 / 3, 0.0])
    loss_no_delta, _ = policy_loss(logp, old, adv, mask, LossConfig())
    close(loss_no_delta, (1.8 + 1.3 - 1.2) / 3)


def test_sequence_level_ratio_is_the_geometric_mean_over_tokens():
    # GSPO: tokens with log-ratios (ln 2, 0) -> sequence log-ratio ln(2) / 2, r = sqrt(2) = 1.414214 on both tokens
    #   A = +1: clipped to 1.2 -> l = -1.2 per token, grpo mean -> loss -1.2
    #   A = -1: l = sqrt(2) per token -> loss 1.414214; dl/dlogp_t = r * (1/2) = 0.707107 on each token
    old = torch.zeros(1, 2, dtype=torch.float64)
    mask = torch.ones(1, 2)
    cfg = LossConfig(importance_level="sequence")
    logp = torch.tensor([[math.log(2), 0.0]], dtype=torch.float64, requires_grad=True)
    loss, metrics = policy_loss(logp, old, t(1.0), mask, cfg)
    close(loss, -1.2)
    assert metrics["clip/ratio_high"] == 1.0 and metrics["ratio/mean"] == pytest.approx(math.sqrt(2))
    loss, _ = policy_loss(logp, old, t(-1.0), mask, cfg)
    close(loss, 1.414214)
    loss.backward()
    close(logp.grad, [[0.707107, 0.707107]])
    # token level on the same input: ratios (2, 1) with A = -1 -> l = (2, 1), mean 1.5
    close(policy_loss(logp, old, t(-1.0), mask, LossConfig())[0], 1.5)


# --------------------------------------------------------------------------- policy loss: against a naive loop


def naive_policy_loss(logp, old, adv, mask, cfg, ref=None, max_len=None, num_items=None, entropy=None):
    """The loss written element by element, straight from the formulas in docs/loss.md."""
    B, T = logp.shape
    sums, lengths = [], []
    for i in range(B):
        tokens = [j for j in range(T) if mask[i, j]]
        seq_log_ratio = sum((logp[i, j] - old[i, j] for j in tokens), torch.tensor(0.0, dtype=logp.dtype)) / max(1, len(tokens))
        total = torch.tensor(0.0, dtype=logp.dtype)
        for j in tokens:
            log_ratio = seq_log_ratio if cfg.importance_level == "sequence" else logp[i, j] - old[i, j]
            r = torch.exp(log_ratio)
            if cfg.type == "reinforce":
                l = -logp[i, j] * adv[i]
            else:
                first = (r if cfg.delta is None or r < cfg.delta else torch.tensor(cfg.delta, dtype=r.dtype)) * adv[i]
                second = torch.clamp(r, 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high) * adv[i]
                l = -(first if first < second else second)
            if cfg.kl_coef > 0:
                d = ref[i, j] - logp[i, j]
                k = {"k1": -d, "k2": d * d / 2, "k3": torch.exp(d) - d - 1}[cfg.kl_estimator]
                l = l + cfg.kl_coef * k
            if cfg.entropy_coef > 0:
                l = l - cfg.entropy_coef * entropy[i, j]
            total = total + l
        sums.append(total)
        lengths.append(len(tokens))
    if cfg.type == "grpo":
        return sum(s / max(1, n) for s, n in zip(sums, lengths)) / B
    if cfg.type == "bnpo":
        return sum(sums) / max(1, sum(lengths))
    if cfg.type == "dr_grpo":
        return sum(sums) / (B * max_len)
    if cfg.type == "dapo":
        return sum(sums) / num_items
    return sum(sums) / B  # reinforce


def _random_batch(seed, B=6, T=8, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    lengths = [T, 0, 1, 3, T - 1, 5][:B]  # ragged, with an empty completion
    mask = torch.tensor([[j < n for j in range(T)] for n in lengths])
    old = -torch.rand(B, T, generator=gen, dtype=dtype) * 3
    # ratios spread over roughly [0.5, 2], so both clip sides and delta are hit
    logp = old + torch.randn(B, T, generator=gen, dtype=dtype) * 0.4
    ref = old + torch.randn(B, T, generator=gen, dtype=dtype) * 0.3
    entropy = torch.rand(B, T, generator=gen, dtype=dtype) * 2
    adv = torch.randn(B, generator=gen, dtype=dtype)
    # padding holds garbage: it must not reach the loss or the gradient
    logp = logp.masked_fill(~mask, -float("inf"))
    old = old.masked_fill(~mask, NAN)
    ref = ref.masked_fill(~mask, NAN)
    entropy = entropy.masked_fill(~mask, NAN)
    return logp, old, adv, mask, ref, entropy


CONFIGS = [
    LossConfig(type=kind, kl_coef=kl, kl_estimator=est, importance_level=level, delta=delta, entropy_coef=ent, clip_eps_high=high)
    for kind in ("grpo", "bnpo", "dr_grpo", "dapo", "reinforce")
    for (kl, est, level, delta, ent, high) in [
        (0.0, "k3", "token", None, 0.0, 0.2),
        (0.04, "k3", "token", 1.5, 0.01, 0.28),
        (0.1, "k1", "sequence", None, 0.0, 0.2),
        (0.1, "k2", "sequence", 1.3, 0.05, 0.2),
    ]
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.type}-{c.importance_level}-{c.kl_estimator}-kl{c.kl_coef}-d{c.delta}")
@pytest.mark.parametrize("seed", [0, 1])
def test_vectorised_loss_and_gradients_match_the_naive_loop(cfg, seed):
    logp, old, adv, mask, ref, entropy = _random_batch(seed)
    num_items = int(mask.sum()) + 11  # the generation batch holds more tokens than this micro-batch
    kwargs = dict(ref_logprobs=ref, max_completion_length=8, num_items=num_items)
    fast_logp = logp.clone().requires_grad_()
    fast_ent = entropy.clone().requires_grad_()
    loss, metrics = policy_loss(fast_logp, old, adv, mask, cfg, entropy=fast_ent, **kwargs)
    loss.backward()

    slow_logp = logp.clone().requires_grad_()
    slow_ent = entropy.clone().requires_grad_()
    expected = naive_policy_loss(slow_logp, old, adv, mask, cfg, ref, 8, num_items, slow_ent)
    expected.backward()

    close(loss, expected.detach(), atol=1e-10)
    grad, expected_grad = fast_logp.grad, slow_logp.grad.nan_to_num(0.0)  # the loop never touches padding
    assert torch.isfinite(grad).all()
    close(grad, expected_grad, atol=1e-10)
    if cfg.entropy_coef > 0:  # the bonus is differentiated through the entropy too
        close(fast_ent.grad, slow_ent.grad.nan_to_num(0.0), atol=1e-10)
    else:
        assert fast_ent.grad is None and slow_ent.grad is None
    assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values())


def test_metrics_against_a_naive_count():
    logp, old, adv, mask, ref, entropy = _random_batch(3)
    cfg = LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.1)
    _, metrics = policy_loss(logp, old, adv, mask, cfg, ref_logprobs=ref, entropy=entropy)
    low = high = n = 0
    ratio_sum = kl_sum = ent_sum = 0.0
    for i, j in mask.nonzero().tolist():
        r, a = math.exp(logp[i, j] - old[i, j]), float(adv[i])
        low += r < 0.8 and a < 0
        high += r > 1.28 and a > 0
        n += 1
        ratio_sum += r
        d = float(ref[i, j] - logp[i, j])
        kl_sum += math.exp(d) - d - 1
        ent_sum += float(entropy[i, j])
    assert low > 0 and high > 0  # the random batch does exercise both sides
    assert metrics["clip/ratio_low"] == pytest.approx(low / n, abs=1e-12)
    assert metrics["clip/ratio_high"] == pytest.approx(high / n, abs=1e-12)
    assert metrics["clip/ratio_region"] == pytest.approx((low + high) / n, abs=1e-12)
    assert metrics["ratio/mean"] == pytest.approx(ratio_sum / n, abs=1e-12)
    assert metrics["kl/mean"] == pytest.approx(kl_sum / n, abs=1e-12)
    assert metrics["entropy/mean"] == pytest.approx(ent_sum / n, abs=1e-12)


@pytest.mark.parametrize("kind", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_at_ratio_one_the_clipped_gradient_is_reinforce_over_the_normaliser(kind):
    # With old = logp.detach() the ratio is exactly 1, inside the clip range, so
    # d(-r A)/dlogp_it = -A_i, the same per-token gradient as REINFORCE's -logp_it A_i.
    # REINFORCE: (1/B) sum_i sum_t -A_i logp_it -> grad_it = -A_i / B. The aggregations give
    #   grpo:    (1/B) sum_i (1/L_i) sum_t   -> grad_it = -A_i / (B L_i)      = reinforce / L_i
    #   bnpo:    sum_i sum_t / sum_i L_i     -> grad_it = -A_i / sum L        = reinforce * B / sum L
    #   dr_grpo: sum_i sum_t / (B L_max)     -> grad_it = -A_i / (B L_max)    = reinforce / L_max
    #   dapo:    sum_i sum_t / num_items     -> grad_it = -A_i / num_items    = reinforce * B / num_items
    logp, _, adv, mask, _, _ = _random_batch(5)
    B, L_max, num_items = logp.shape[0], 8, 100
    lengths = mask.sum(dim=1, keepdim=True).double()  # [B, 1]
    kwargs = dict(max_completion_length=L_max, num_items=num_items)

    clipped_logp = logp.clone().requires_grad_()
    policy_loss(clipped_logp, clipped_logp.detach(), adv, mask, LossConfig(type=kind), **kwargs)[0].backward()
    reinforce_logp = logp.clone().requires_grad_()
    policy_loss(reinforce_logp, logp, adv, mask, LossConfig(type="reinforce"))[0].backward()

    scale = {"grpo": 1 / lengths.clamp(min=1), "bnpo": B / mask.sum(), "dr_grpo": 1 / L_max, "dapo": B / num_items}[kind]
    close(clipped_logp.grad, reinforce_logp.grad * scale, atol=1e-12)
    assert reinforce_logp.grad.abs().sum() > 0


def test_kl_term_gradient_pulls_towards_the_reference():
    # k3 with kl_coef 0.5, zero advantage, one token: logp = -1, ref = -1.5 -> d k3/d logp = 1 - e^(ref - logp)
    # = 1 - e^-0.5 = 0.393469; loss = 0.5 * k3 = 0.5 * 0.106531 = 0.053265, gradient 0.5 * 0.393469 = 0.196735
    logp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    loss, metrics = policy_loss(logp, logp.detach(), t(0.0), torch.ones(1, 1), LossConfig(kl_coef=0.5), ref_logprobs=t(-1.5).view(1, 1))
    close(loss, 0.053265)
    loss.backward()
    close(logp.grad, [[0.196735]])
    assert metrics["kl/mean"] == pytest.approx(0.106531, abs=1e-6) and metrics["loss/policy"] == 0.0


def test_entropy_bonus_is_subtracted():
    # zero advantage, entropy_coef 0.1, token entropies (2, 4) over 2 active tokens of one sequence:
    # grpo loss = -(0.1 * 2 + 0.1 * 4) / 2 = -0.3
    logp = torch.zeros(1, 3, dtype=torch.float64)
    entropy = t(2.0, 4.0, 100.0).view(1, 3)
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = policy_loss(logp, logp, t(0.0), mask, LossConfig(entropy_coef=0.1), entropy=entropy)
    close(loss, -0.3)
    assert metrics["entropy/mean"] == pytest.approx(3.0)


def test_float32_micro_batch_with_grad():
    # the update stage's case: float32 logprobs from the model, old/ref read back as float64, bool mask
    logp, old, adv, mask, ref, _ = _random_batch(7, dtype=torch.float32)
    logp = logp.requires_grad_()
    cfg = LossConfig(type="dapo", kl_coef=0.04)
    loss, metrics = policy_loss(logp, old.double(), adv.double(), mask, cfg, ref_logprobs=ref.double(), num_items=40)
    assert loss.dtype == torch.float32 and loss.requires_grad
    loss.backward()
    assert logp.grad.dtype == torch.float32 and torch.isfinite(logp.grad).all()
    assert logp.grad[~mask].abs().sum() == 0 and logp.grad[mask].abs().sum() > 0
    assert isinstance(metrics["loss/total"], float)


def test_bf16_logprobs_are_reduced_in_float32():
    # bnpo at ratio 1 (l = -r A = -A): sequence 0 has 300 tokens with A = 1, sequence 1 one token with A = 0
    # -> loss = -300 / 301 = -0.996678. In bf16 the count 301 rounds to 300 and the loss would read -1.
    logp = torch.full((2, 300), -1.0, dtype=torch.bfloat16, requires_grad=True)
    mask = torch.zeros(2, 300, dtype=torch.bool)
    mask[0, :] = True
    mask[1, 0] = True
    loss, _ = policy_loss(logp, logp.detach(), torch.tensor([1.0, 0.0]), mask, LossConfig(type="bnpo"))
    assert loss.dtype == torch.float32
    close(loss, -300 / 301)
    loss.backward()
    assert logp.grad.dtype == torch.bfloat16 and torch.isfinite(logp.grad).all()


def test_missing_arguments_raise_clear_errors():
    logp = torch.zeros(2, 3)
    mask, adv = torch.ones(2, 3), torch.zeros(2)
    with pytest.raises(ValueError, match="dr_grpo needs max_completion_length"):
        policy_loss(logp, logp, adv, mask, LossConfig(type="dr_grpo"))
    with pytest.raises(ValueError, match="dapo needs num_items"):
        policy_loss(logp, logp, adv, mask, LossConfig(type="dapo"))
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        policy_loss(logp, logp, adv, mask, LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="needs the per-token entropy"):
        policy_loss(logp, logp, adv, mask, LossConfig(entropy_coef=0.1))
    with pytest.raises(ValueError, match="advantages must be"):
        policy_loss(logp, logp, torch.zeros(3), mask, LossConfig())
    with pytest.raises(ValueError, match="mask has shape"):
        policy_loss(logp, logp, adv, torch.ones(2, 4), LossConfig())
