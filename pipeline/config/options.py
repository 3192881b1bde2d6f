"""`grpo init`'s options as config keys: a run from the command line alone, as TRL users start
one (`trl grpo --model_name_or_path ... --dataset_name ... --reward_funcs ...`), or a config
file with a few keys changed.

Precedence: field defaults < the --config file < the options below < `--set dotted.key=value`.
An option and a `--set` of the same key (or of a section holding it) is an error: say it once.
A `--set` below an option's key refines what the option set (`--reward contains
--set rewards.0.kwargs.keyword=yes`). `--reward` (repeatable) replaces the file's whole
`rewards:` list. The result is validated once, like a file, so options only and the same
settings in YAML resolve to the same config (and config hash).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.config import Config, resolve
from pipeline.config.errors import parse_overrides, put_dotted, read_tree
from pipeline.errors import GRPOError

OPTIONS: dict[str, str] = {
    "--model": "model",
    "--data": "data.train",
    "--eval-data": "data.eval",
    "--prompt-column": "data.prompt_column",
    "--reward": "rewards",
    "--engine": "rollout.engine",
    "--num-generations": "rollout.num_generations",
    "--prompts-per-iter": "rollout.prompts_per_iter",
    "--max-new-tokens": "rollout.max_new_tokens",
    "--temperature": "rollout.temperature",
    "--mini-batch-size": "train.mini_batch_size",
    "--lr": "train.lr",
    "--total-iters": "train.total_iters",
    "--lora-rank": "train.lora.r",
    "--loss-type": "loss.type",
    "--kl-coef": "loss.kl_coef",
    "--seed": "seed",
}
"""Each option of `grpo init` and the config key it sets."""

REQUIRED = ("--model", "--data", "--reward")
"""What a run needs when there is no --config file to supply it."""

SOURCE = "grpo init"
"""How an error names the command line when no file or option is to blame."""


def reward_entry(text: str) -> dict[str, Any]:
    """A `--reward` value as a `rewards:` entry: `correct`, `file.py:fn` or `module:fn`, with an
    optional weight after the last `=`: `format=0.5` is {fn: format, weight: 0.5}."""
    fn, eq, weight = text.rpartition("=")
    if not eq:
        return {"fn": text}
    try:
        value = float(weight)
    except ValueError:
        raise GRPOError(f"--reward {text}: expected NAME or NAME=WEIGHT with a number after '=', got {weight!r}") from None
    if not fn:
        raise GRPOError(f"--reward {text}: no reward function before '='")
    return {"fn": fn, "weight": value}


def _covers(key: str, other: str) -> bool:
    """Whether setting `key` replaces `other`: the same key or a section holding it."""
    return other == key or other.startswith(key + ".")


def from_command_line(config: str | Path | None, given: dict[str, Any], sets: list[str] | None = None) -> Config:
    """The config of `grpo init [--config FILE] [options] [--set k=v ...]`. `given`: option ->
    value, None (or an empty list) for an option left out."""
    given = {flag: v for flag, v in given.items() if v is not None and v != []}
    unknown = set(given) - set(OPTIONS)
    assert not unknown, f"no config key for {sorted(unknown)}"  # a stage/table mismatch, not a user's mistake
    set_keys = [key for key, _ in parse_overrides(sets)]
    for flag, value in given.items():
        clash = next((s for s in set_keys if _covers(s, OPTIONS[flag])), None)
        if clash is not None:
            raise GRPOError(f"{flag} and --set {clash} both set {OPTIONS[flag]}; give one of them")
    if config is None:
        missing = [f for f in REQUIRED if f not in given and not any(_covers(s, OPTIONS[f]) for s in set_keys)]
        if missing:
            raise GRPOError(f"{SOURCE}: missing {', '.join(missing)} (give {'them' if len(missing) > 1 else 'it'}, or --config FILE)")
        tree, source = {}, SOURCE
    else:
        tree, source = read_tree(config), str(config)
    sources: dict[str, str] = {}
    for flag, value in given.items():
        if flag == "--reward":
            value = [reward_entry(v) for v in value]
            sources.update({f"rewards.{i}": f"--reward {text}" for i, text in enumerate(given[flag])})
        else:
            sources[OPTIONS[flag]] = f"{flag} {value}"
        put_dotted(tree, OPTIONS[flag], value, flag)
    sources.update({key: source for key in set_keys})  # a --set below an option's key is to blame for itself
    return resolve(tree, sets, source=source, sources=sources)
