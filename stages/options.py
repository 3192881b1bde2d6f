"""Option types shared by the commands, declared once."""

from pathlib import Path
from typing import Annotated, Optional

import typer

RunArg = Annotated[str, typer.Argument(help="Run directory: a local path or an fsspec URI (s3://bucket/run).", show_default=False)]
IterOpt = Annotated[Optional[int], typer.Option("--iter", min=0, help="Iteration; default: the first one this stage has not done.")]
ShardOpt = Annotated[Optional[str], typer.Option("--shard", help="i/N: this worker writes every N-th part (0-based i).")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="Override a config key: dotted.key=value (repeatable).")]
ConfigOpt = Annotated[Optional[Path], typer.Option("--config", "-c", help="YAML config file; optional when --model, --data and --reward are given.", dir_okay=False, show_default=False)]
FormatOpt = Annotated[str, typer.Option("--format", help="table or json.")]

# `grpo init`'s run settings: each sets one config key (pipeline/config/options.py OPTIONS)
_RUN = "Run settings (override --config; --set overrides them)"


def _init_opt(flag: str, help: str, **kw):
    return typer.Option(flag, help=help, rich_help_panel=_RUN, show_default=False, **kw)


ModelOpt = Annotated[Optional[str], _init_opt("--model", "model: the initial policy, a Hugging Face model directory or a .gguf file.")]
DataOpt = Annotated[Optional[str], _init_opt("--data", "data.train: training prompts (.jsonl, .json, .parquet, Parquet shards, a datasets directory).")]
EvalDataOpt = Annotated[Optional[str], _init_opt("--eval-data", "data.eval: held-out prompts for periodic evaluation.")]
PromptColumnOpt = Annotated[Optional[str], _init_opt("--prompt-column", "data.prompt_column: the column holding the prompt (default prompt).")]
RewardOpt = Annotated[Optional[list[str]], _init_opt(
    "--reward", "rewards: a built-in (correct, format, contains, ...), file.py:fn or module:fn in TRL's contract, "
    "optionally =WEIGHT (format=0.5); repeatable, in order.")]
EngineOpt = Annotated[Optional[str], _init_opt("--engine", "rollout.engine: vllm or hf (default vllm).")]
NumGenerationsOpt = Annotated[Optional[int], _init_opt("--num-generations", "rollout.num_generations: G, completions per prompt (default 8).")]
PromptsPerIterOpt = Annotated[Optional[int], _init_opt("--prompts-per-iter", "rollout.prompts_per_iter: prompts per iteration (default 16).")]
MaxNewTokensOpt = Annotated[Optional[int], _init_opt("--max-new-tokens", "rollout.max_new_tokens: completion length cap, TRL's max_completion_length (default 64).")]
TemperatureOpt = Annotated[Optional[float], _init_opt("--temperature", "rollout.temperature: sampling temperature (default 1.0).")]
MiniBatchOpt = Annotated[Optional[int], _init_opt("--mini-batch-size", "train.mini_batch_size: completions per optimizer step (default 32).")]
LrOpt = Annotated[Optional[float], _init_opt("--lr", "train.lr: peak learning rate, TRL's learning_rate (default 1e-5).")]
TotalItersOpt = Annotated[Optional[int], _init_opt("--total-iters", "train.total_iters: iterations the LR schedule spans (default 100).")]
LoraRankOpt = Annotated[Optional[int], _init_opt("--lora-rank", "train.lora.r: train a LoRA adapter of this rank instead of every weight.")]
LossTypeOpt = Annotated[Optional[str], _init_opt("--loss-type", "loss.type: grpo, bnpo, dr_grpo, dapo or reinforce (default grpo).")]
KlCoefOpt = Annotated[Optional[float], _init_opt("--kl-coef", "loss.kl_coef: KL penalty weight, TRL's beta (default 0: no reference pass).")]
SeedOpt = Annotated[Optional[int], _init_opt("--seed", "seed: the one seed of prompt order, sampling and shuffles (default 0).")]
