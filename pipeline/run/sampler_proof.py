"""A sampler that proves what it samples. A policy's manifest hashes its stored files; nothing there
says the engine holds them (a reload that does nothing, a key a non-strict load dropped). Three checks:

- `check_engine`: after every engine load, the engine's logprobs of a fixed probe (a short text, its
  tokens teacher-forced at temperature 1) against the same logprobs from the policy's stored files,
  computed here in fp32 on the CPU. Their mean gap must be within what the engine's dtype explains.
  Works the same for vLLM and transformers engines, whole weights, merged LoRA and vLLM's LoRA
  requests: it asks the engine what it computes, not what it was told to load.
- `pipeline.models.strict.load_strict`: a state dict loaded into a model must fill every weight (only
  a tied LM head may be missing: it is the embedding) and hold nothing the model lacks.
- `check_sampler_gap`: an on-policy iteration's sampler gap (|old - sampler| per model token, the
  logprobs stage's `logprobs/sampler_gap_mean`) within what the engine's and trainer's dtypes explain.

The limits (`GAP_LIMITS`) are on a mean |logprob difference| in nats, for the coarser of the two
dtypes; docs/off-policy.md gives the measurements they come from.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.errors import GRPOError

PROBE_TEXT = "The sampler holds the policy its manifest names: 17 + 25 = 42, and the answer is 42."
"""What the probe's tokens spell (any fixed text does; this one mixes words, digits and punctuation)."""

GAP_LIMITS = {"float32": 1e-3, "fp32": 1e-3, "float16": 0.05, "bfloat16": 0.1, "bf16": 0.1}
"""Mean |logprob gap| (nats) that two computations of the same policy may differ by, for the coarser
of their dtypes. fp32 against fp32: measured 0 to 1e-6 (transformers and vLLM on a CPU), while a
policy one update at lr 1e-3 away is over 1e-3 (tests/test_sampler_proof.py). bf16: rounding of
weights and activations, measured 0.003 to 0.005 on the tiny model and 0.026 to 0.041 (sampler gap,
vLLM bf16 beside a bf16 trainer) on SmolLM2-135M, so 0.1: a stale policy must be further off than
that to be seen; the fp32 check is the sharp one. fp16: not measured, set between the two."""


def gap_limit(*dtypes: str) -> float:
    """The gap limit of the coarsest of `dtypes` (engine dtype names or train precisions)."""
    return max(GAP_LIMITS[d] for d in dtypes)


def probe_ids(tokenizer) -> list[int]:
    return tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]


def reference_probe(run, k: int, ids: list[int], policy) -> np.ndarray:
    """Policy k's logprobs of ids[1:] given the tokens before each, at temperature 1, from its stored
    files in fp32 on the CPU (`policy`, the run's `pipeline.run.policy` object, loads it: a LoRA
    policy is the base with its adapter). Cached per policy hash; a policy whose write is in flight
    here: the reference that write computed from the same tensors (`remember`), before its hash settles."""
    key = (run.policy_hash(k), tuple(ids))  # a write in flight: settles its hash, remembered before it
    if key not in _REFERENCE:
        import torch

        model = policy.probe_model(run, k)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()  # [P-1, V]
        _REFERENCE[key] = _logprobs_of(logits, ids)
        del model
    return _REFERENCE[key]


_REFERENCE: dict[tuple, np.ndarray] = {}


def remember(policy_hash: str, reference: tuple[tuple, np.ndarray] | None) -> None:
    """The reference of the policy `policy_hash` names, as `reference_meanwhile`'s function computed
    it beside the policy's write (None: not computed there; the proof reads the stored file)."""
    if reference is not None:
        _REFERENCE[(policy_hash, reference[0])] = reference[1]


def _logprobs_of(logits, ids: list[int]) -> np.ndarray:
    import torch

    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()


def reference_meanwhile(config_dir):
    """A function computing, from a policy's tensors in memory, its reference probe (what
    `reference_probe` answers), made to run on the policy's background write thread while the engine
    loads the same weights: ({name: tensor}, where) -> (ids, logprobs). Its model is built here, once
    per model config, in the calling thread: the thread only hands it the tensors and runs the
    forward, touching no global state (building a model patches torch's initialisers process-wide,
    which an engine loading weights at the same moment would see)."""
    import torch

    from pipeline.models.strict import load_strict
    from pipeline.models.tokenizer_cache import tokenizer_of
    from pipeline.run.weights_file import emptied, empty_model

    config = (Path(config_dir) / "config.json").read_bytes()
    ids = probe_ids(tokenizer_of(config_dir))
    if config not in _SKELETON:
        _SKELETON.clear()
        _SKELETON[config] = empty_model(Path(config_dir))
    model = _SKELETON[config]

    def compute(tensors: dict, where: str) -> tuple[tuple, np.ndarray]:
        load_strict(model, tensors, where, assign=True)
        model.tie_weights()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
        emptied(model)  # the tensors go back to their owner (the optimizer steps them next)
        return tuple(ids), _logprobs_of(logits, ids)

    return compute


_SKELETON: dict[bytes, object] = {}
"""The fp32 model a background write computes its reference with, per config.json (one kept)."""


def check_engine(run, k: int, engine, policy, where: str) -> float:
    """Raise a one-line GRPOError when `engine` does not compute policy k's probe logprobs within
    its dtype's limit; returns the gap. `policy`: the run's policy object; `where`: who loaded it
    ("rollout iteration 3")."""
    from pipeline.models.tokenizer_cache import tokenizer_of

    ids = probe_ids(tokenizer_of(run.plain_dir(k)))
    got = np.asarray(engine.probe(ids), np.float64)
    want = reference_probe(run, k, ids, policy).astype(np.float64)
    gap = float(np.abs(got - want).mean())
    limit = gap_limit(engine.dtype)
    if not np.isfinite(gap) or gap > limit:
        raise GRPOError(f"{where}: the {engine.dtype} engine does not hold policy/iter-{k:04d}: its logprobs of a fixed "
                        f"{len(ids)}-token probe differ from the stored policy's by {gap:.3g} (mean), over the {limit:g} "
                        "its dtype explains (a reload that left the old weights?)")
    return gap


def check_sampler_gap(cfg, k: int, row_gaps: list[float], where: str, run=None) -> None:
    """Raise a one-line GRPOError when on-policy iteration k's sampler gap (the mean over rows of each
    row's mean |old - sampler| over its model tokens) exceeds what the dtypes explain. Not checked
    where the gap has another cause: an older behaviour policy (train.max_staleness) or truncated
    sampling (the engine's logprobs are renormalised over the kept tokens: docs/loss.md), or a
    replayed rollout (`run` given: its completions were sampled by another run's policy)."""
    from pipeline.schedule import iteration_plan
    from pipeline.models.engine_base import engine_dtype
    from pipeline.models.tokens import resolve_precision

    r = cfg.rollout
    if iteration_plan(cfg, k).behaviour != k or r.top_p < 1 or r.top_k > 0 or (r.min_p or 0) > 0 or not row_gaps:
        return
    if run is not None and run.manifest(k, "rollout").replayed_from is not None:
        return
    gap = float(np.mean(row_gaps))
    dtypes = (engine_dtype(r.dtype, cfg.train.precision), resolve_precision(cfg.train.precision))
    limit = gap_limit(*dtypes)
    if not np.isfinite(gap) or gap > limit:
        raise GRPOError(f"{where}: on-policy iteration {k}'s sampler gap is {gap:.3g} (mean |old - sampler| logprob), over the "
                        f"{limit:g} that a {dtypes[0]} engine and {dtypes[1]} trainer explain: the engine did not sample "
                        f"policy/iter-{k:04d}")
