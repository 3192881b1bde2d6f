"""Cases on the tokens the loss sees: the end-of-sequence token kept when padding shares its id, and
the logprobs taken at the temperature the engine sampled at.

The implementations asked: a `Masker`, `mask(prompt_ids, completion_ids, pad_id)` -> the loss mask
[B, T] (grpo's `Batch.build`), and a `Scorer`, `(model, logprobs(model, prompt_ids, completion_ids, T))`
-> per-token logprobs [B, T] of the completions (grpo's `token_logprobs`; TRL's trainer forward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pipeline.conformance.case import Case
from pipeline.conformance.impls import Logprober

EOS = PAD = 2  # a tokenizer whose pad token is its eos token (Llama, Qwen base models, SmolLM2)


@dataclass(frozen=True)
class Masker:
    mask: Callable


def grpo_masker() -> Masker:
    from pipeline.models.tokens import Batch

    return Masker(lambda p, c, pad: Batch.build(p, c, pad_id=pad).loss_mask)


def pad_matching_masker() -> Masker:
    """TRL #6357 (GKD, GOLD): the mask built as `ids != pad_id`, so with pad == eos the EOS is masked."""
    from pipeline.models.tokens import Batch

    return Masker(lambda p, c, pad: (Batch.build(p, c, pad_id=pad).completion_ids != pad).float())


def tiny_llama(seed: int = 0):
    """A random one-layer Llama over 40 tokens: enough to have logits that depend on the context."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)).eval()


def _grpo_logprobs(model, prompts, comps, T):
    import torch

    from pipeline.models.tokens import Batch, token_logprobs

    with torch.no_grad():
        return token_logprobs(model, Batch.build(prompts, comps), T)[0]


def grpo_logprober() -> Logprober:
    return Logprober(tiny_llama(), _grpo_logprobs)


def untempered_logprober() -> Logprober:
    """TRL before #3029 (and TRL #4159's vLLM side): the logprobs of softmax(logits), T left out."""
    return Logprober(tiny_llama(), lambda model, p, c, T: _grpo_logprobs(model, p, c, 1.0))


# --------------------------------------------------------------------------- experiments

def eos_experiment(m: Masker) -> tuple[bool, str]:
    # a completion that stopped on EOS, a shorter one that did, one cut at the length limit (no EOS)
    comps = [[5, 6, EOS], [7, EOS], [8, 9, 10]]
    mask = m.mask([[1, 3], [1, 3], [1, 4]], comps, PAD)
    # expected: 1 on every sampled token, EOS included; 0 on the padding only
    want = [[1, 1, 1], [1, 1, 0], [1, 1, 1]]
    got = [[int(v) for v in row] for row in mask.tolist()]
    return got == want, f"mask {got} (EOS at [0][2], [1][1])"


def temperature_experiment(lp: Logprober) -> tuple[bool, str]:
    import torch

    prompts, comps = [[1, 2, 3], [4, 5]], [[6, 7, 8, 9], [10, 11]]
    worst = 0.0
    for T in (0.7, 1.6):
        got = lp.logprobs(lp.model, prompts, comps, T)
        with torch.no_grad():
            for i, (p, c) in enumerate(zip(prompts, comps)):
                logits = lp.model(torch.tensor([p + c])).logits[0, len(p) - 1:-1].double()  # [len(c), V] predicting c
                want = torch.log_softmax(logits / T, -1)[torch.arange(len(c)), torch.tensor(c)]  # the sampler's
                worst = max(worst, float((got[i, :len(c)].double() - want).abs().max()))
    # without the division by T the logprobs differ by 1e-2 or more on this model
    return worst < 1e-4, f"max |logp - log_softmax(logits / T)| = {worst:.2e} at T in (0.7, 1.6)"


def cases() -> list[Case]:
    from pipeline.conformance import trl_adapter as trl

    return [
        Case("eos-kept-when-pad-is-eos", "the EOS a completion stopped on is trained, even when pad == eos",
             "TRL #6357", "loss_mask = 1 on every sampled token incl. EOS, 0 on padding only",
             eos_experiment, grpo_masker, pad_matching_masker,
             trl_na="not measured: TRL builds the mask inline from its own generation; these completions would need it replaced"),
        Case("logprobs-at-sampling-temperature", "logprobs are those of softmax(logits / T) the engine sampled from",
             "TRL #4159, fixed in TRL by #3029", "logp(y_t) = log_softmax(z_t / T)[y_t] at T = 0.7 and 1.6",
             temperature_experiment, grpo_logprober, untempered_logprober, trl=trl.logprober),
    ]
