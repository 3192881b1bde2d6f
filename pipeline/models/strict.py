"""Strict weight loads: what the engines and the logprob pass load in place must fill every weight
of the model (only a tied LM head may be missing: it is the embedding) and hold nothing the model
lacks. `load_state_dict(strict=False)` dropped mismatched keys silently. A leaf module, so that the
engines and the policy objects can import it."""

from __future__ import annotations

from pipeline.errors import GRPOError


def load_strict(model, state: dict, where: str, assign: bool = False) -> None:
    """`model.load_state_dict(state)` where every weight must be in `state` except a tied LM head
    (the embedding it shares), and nothing in `state` may be unknown to the model. `assign`: the
    model takes `state`'s tensors themselves (no copy)."""
    result = model.load_state_dict(state, strict=False, assign=assign)
    _refuse_mismatch(model, result.missing_keys, result.unexpected_keys, where)


def _refuse_mismatch(model, missing: list[str], unexpected: list[str], where: str) -> None:
    """One line naming what is missing (a tied LM head aside) or unknown to the model, if anything is."""
    head = model.get_output_embeddings() if getattr(model.config, "tie_word_embeddings", False) else None
    missing = [n for n in missing if not (head is not None and n.endswith("lm_head.weight"))]
    unexpected = list(unexpected)
    if missing or unexpected:
        what = "; ".join(f"{label} {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''} ({len(keys)})"
                         for label, keys in (("missing", missing), ("unexpected", unexpected)) if keys)
        raise GRPOError(f"{where}: the weights do not match the model: {what}")


def load_dir_strict(model, model_dir, where: str) -> None:
    """A stored model directory's weights into `model`, strictly. Its safetensors files are read as
    they are; where their names are not the model's (transformers 5 converts some checkpoints as it
    loads them, e.g. a mixture of experts' per-expert weights into fused ones), the directory is
    loaded through `from_pretrained`, which converts, and its weights are taken from there."""
    from pathlib import Path

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    state: dict = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        state.update(load_file(f))
    if set(state) <= set(model.state_dict()):
        load_strict(model, state, where)
        return
    dtype = next(model.parameters()).dtype
    fresh, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, output_loading_info=True)
    # from_pretrained would fill a missing weight at random and drop an unknown one
    _refuse_mismatch(model, sorted(info.get("missing_keys", [])), sorted(info.get("unexpected_keys", [])), where)
    load_strict(model, fresh.state_dict(), where)
