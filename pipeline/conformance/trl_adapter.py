"""TRL's GRPOTrainer as an implementation the conformance experiments can ask (TRL 1.16, the `test`
and `bench` extras): the same experiment, run on TRL's own code, on the suite's tiny model.

- `scorer`: rewards to advantages through `GRPOTrainer._generate_and_score_completions` (its own
  generation on the tiny model, then its reward and advantage code, which is what is measured): the
  reward functions return the experiment's table, column by column, so the completions' text does not
  matter; `contract` runs a TRL-contract function through `_calculate_rewards`.
- `logprober`: the trainer's forward (`_get_per_token_logps_and_entropies`, with the fused head TRL
  installs at `temperature`) on the tiny model's weights.

The tiny model is the one `use_model` names (the suite's; `grpo conformance` builds one). Without it,
or without TRL, a builder raises ImportError and the row says why instead of passing.
"""

from __future__ import annotations

import os
import tempfile
from functools import lru_cache

import numpy as np

_MODEL: list[str] = []
TEMPERATURE = 0.7
TABLE: dict[str, np.ndarray] = {}  # the reward table the trainer's reward functions return


def use_model(path: str) -> None:
    """The tiny model (a directory with its tokenizer and chat template) TRL's trainer is built on."""
    _MODEL[:] = [str(path)]
    _trainer.cache_clear()


def version() -> str:
    import trl

    return trl.__version__


def _column(j: int):
    def reward(completions, **kwargs):
        col = TABLE["per_fn"][:, j]
        return [None if np.isnan(v) else float(v) for v in col[: len(completions)]]
    reward.__name__ = f"table_{j}"
    return reward


@lru_cache(maxsize=3)
def _trainer(temperature: float = TEMPERATURE, G: int = 4, aggregation: str = "sum_then_normalize"):
    if not _MODEL:
        raise ImportError("no tiny model given (pipeline.conformance.trl_adapter.use_model)")
    os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="conformance-trl-"), per_device_train_batch_size=G, num_generations=G,
                      max_completion_length=4, temperature=temperature, report_to="none", use_cpu=True, logging_steps=10**6,
                      save_strategy="no", bf16=False, seed=0, multi_objective_aggregation=aggregation)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": "What is 2 + 3?"}]}] * G)
    return GRPOTrainer(model=_MODEL[0], reward_funcs=[_column(0), _column(1)], args=args, train_dataset=data)


def _advantages(per_fn: np.ndarray, weights: np.ndarray, G: int, aggregation: str = "sum_then_normalize") -> np.ndarray:
    import torch

    t = _trainer(G=G, aggregation=aggregation)
    F = per_fn.shape[1]
    TABLE["per_fn"] = np.concatenate([per_fn, np.full((len(per_fn), 2 - F), np.nan)], axis=1)  # 2 functions
    t.reward_weights = torch.tensor([*weights.tolist(), *[1.0] * (2 - F)], dtype=torch.float32)
    out = []
    for start in range(0, len(per_fn), G):  # one group per call: the trainer's batch is one prompt x G
        TABLE["per_fn"] = np.concatenate([per_fn[start:start + G], np.full((G, 2 - F), np.nan)], axis=1)
        t.model.train()
        batch = t._generate_and_score_completions([{"prompt": [{"role": "user", "content": "What is 2 + 3?"}]}] * G)
        out.append(batch["advantages"].detach().double().numpy())
    return np.concatenate(out)


def _contract(values: list) -> np.ndarray:
    """A TRL-contract reward's output as TRL stores it: `_calculate_rewards` (None -> NaN)."""
    from pipeline.conformance.impls import outcome_only

    t = _trainer()
    texts = [str(v) for v in values]
    saved = t.reward_funcs, t.reward_processing_classes, t.reward_func_names
    t.reward_funcs, t.reward_processing_classes, t.reward_func_names = [outcome_only], [None], ["outcome_only"]
    try:
        per_fn = t._calculate_rewards([{"prompt": "q"}] * len(texts), ["q"] * len(texts), texts, [[0]] * len(texts))
    finally:
        t.reward_funcs, t.reward_processing_classes, t.reward_func_names = saved
    return per_fn[:, 0].double().numpy()


def scorer():
    from pipeline.conformance.impls import Scorer

    _trainer()  # TRL importable and the model given, or the row says why
    return Scorer(_advantages, _contract)


def both_aggregations():
    """TRL's two `multi_objective_aggregation`s (TRL 1.16): its default sum_then_normalize and GDPO's
    normalize_then_sum, each as a Scorer; the experiment runs on both and reports both."""
    from pipeline.conformance.impls import Scorer

    _trainer()
    return {agg: Scorer(lambda per_fn, w, G, agg=agg: _advantages(per_fn, w, G, agg), _contract)
            for agg in ("sum_then_normalize", "normalize_then_sum")}


def _trl_logprobs(model, prompts, comps, T):
    import torch

    t = _trainer(temperature=T)
    keep = max(map(len, comps))
    # left-pad the prompts so every completion ends its row's last `keep` positions, as TRL lays them out
    ids = torch.zeros((len(prompts), len(max(prompts, key=len)) + keep), dtype=torch.long)
    attn = torch.zeros_like(ids)
    Lp = ids.shape[1] - keep
    for i, (p, c) in enumerate(zip(prompts, comps)):
        ids[i, Lp - len(p):Lp], attn[i, Lp - len(p):Lp] = torch.tensor(p), 1
        ids[i, Lp:Lp + len(c)], attn[i, Lp:Lp + len(c)] = torch.tensor(c), 1
    with torch.no_grad():
        logp, _, _ = t._get_per_token_logps_and_entropies(t.model, ids, attn, keep)
    return logp


def logprober():
    from pipeline.conformance.impls import Logprober

    t = _trainer()
    t.model.eval()
    # the experiment asks the plain forward (model(...).logits) for the reference: TRL's model answers both
    return Logprober(_PlainLogits(t.model), lambda model, p, c, T: _trl_logprobs(model, p, c, T))


class _PlainLogits:
    """The trainer's model, called plainly (logits, no labels) for the experiment's reference."""

    def __init__(self, model):
        self.model = model

    def __call__(self, ids):
        return self.model(ids)
