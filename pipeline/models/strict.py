"""Strict weight loads: what the engines and the logprob pass load in place must fill every weight
of the model (only a tied LM head may be missing: it is the embedding) and hold nothing the model
lacks. `load_state_dict(strict=False)` dropped mismatched keys silently. A leaf module, so that the
engines and the policy objects can import it."""

from __future__ import annotations

from pipeline.errors import GRPOError


def load_strict(model, state: dict, where: str) -> None:
    """`model.load_state_dict(state)` where every weight must be in `state` except a tied LM head
    (the embedding it shares), and nothing in `state` may be unknown to the model."""
    result = model.load_state_dict(state, strict=False)
    tied = getattr(model.config, "tie_word_embeddings", False)
    head = model.get_output_embeddings() if tied else None
    missing = [n for n in result.missing_keys if not (head is not None and n.endswith("lm_head.weight"))]
    if missing or result.unexpected_keys:
        what = "; ".join(f"{label} {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''} ({len(keys)})"
                         for label, keys in (("missing", missing), ("unexpected", result.unexpected_keys)) if keys)
        raise GRPOError(f"{where}: the weights do not match the model: {what}")
