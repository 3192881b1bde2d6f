"""`grpo init RUN [--config FILE] [--model M --data D --reward R ...] [--set k=v ...]`: create a run.

Writes RUN/config.yaml (the resolved config) and RUN/policy/iter-0000 (the initial model), then
prints the plan the config implies per iteration (pipeline/preview.py). The options set the
common keys (pipeline/config/options.py); precedence: defaults < file < options < --set.
Refuses to overwrite an existing run with a different config; checks the config, the data and
the reward functions (pipeline/preflight.py) before it writes anything.
"""

from typing import Annotated

import typer

from stages.options import (
    ConfigOpt,
    DataOpt,
    EngineOpt,
    EvalDataOpt,
    KlCoefOpt,
    LoraRankOpt,
    LossTypeOpt,
    LrOpt,
    MaxNewTokensOpt,
    MiniBatchOpt,
    ModelOpt,
    NumGenerationsOpt,
    PromptColumnOpt,
    PromptsPerIterOpt,
    RewardOpt,
    RunArg,
    SeedOpt,
    SetOpt,
    TemperatureOpt,
    TotalItersOpt,
)

EXAMPLE = """Example: your model, your data and a TRL reward function in a file, no YAML:

    grpo init runs/exp1 --model ./my-model --data train.jsonl \\
        --reward my_rewards.py:accuracy --reward format=0.5 --lora-rank 16

Then `grpo iterate runs/exp1 --iters 50`. Precedence: defaults < --config file < options < --set."""


def init(
    run: RunArg,
    config: ConfigOpt = None,
    model: ModelOpt = None,
    data: DataOpt = None,
    eval_data: EvalDataOpt = None,
    prompt_column: PromptColumnOpt = None,
    reward: RewardOpt = None,
    engine: EngineOpt = None,
    num_generations: NumGenerationsOpt = None,
    prompts_per_iter: PromptsPerIterOpt = None,
    max_new_tokens: MaxNewTokensOpt = None,
    temperature: TemperatureOpt = None,
    mini_batch_size: MiniBatchOpt = None,
    lr: LrOpt = None,
    total_iters: TotalItersOpt = None,
    lora_rank: LoraRankOpt = None,
    loss_type: LossTypeOpt = None,
    kl_coef: KlCoefOpt = None,
    seed: SeedOpt = None,
    set: SetOpt = None,
    no_judge_check: Annotated[bool, typer.Option("--no-judge-check", help="Do not ask a served reward's server (a judge, a served reward model) whether it is up (one or two cheap requests each).")] = False,
) -> None:
    """Create a run directory from a config file, from options, or from both."""
    from pipeline import preflight
    from pipeline.config.options import from_command_line
    from pipeline.preview import machine_precision, preview
    from pipeline.run.run import init_run

    given = {
        "--model": model, "--data": data, "--eval-data": eval_data, "--prompt-column": prompt_column,
        "--reward": reward, "--engine": engine, "--num-generations": num_generations,
        "--prompts-per-iter": prompts_per_iter, "--max-new-tokens": max_new_tokens, "--temperature": temperature,
        "--mini-batch-size": mini_batch_size, "--lr": lr, "--total-iters": total_iters, "--lora-rank": lora_rank,
        "--loss-type": loss_type, "--kl-coef": kl_coef, "--seed": seed,
    }
    cfg = from_command_line(config, given, set)
    if cfg.rollout.environment is not None or cfg.rollout.agent is not None:
        # an environment's get_reward is a reward, as in TRL; an endpoint agent's result file gives the reward `agent`:
        # written into the run's rewards
        from pipeline.agents.setup import with_environment_rewards

        cfg = with_environment_rewards(cfg)
    for note in preflight.check(cfg, judges_reachable=not no_judge_check):  # reward functions, dataset header, tools: before anything is written
        print(f"note: {note}")
    r = init_run(run, cfg)
    print(f"run {r.store.display()} ready (config {r.cfg_hash[:12]})")
    print("plan:")
    print("\n".join(preview(cfg, machine_precision(cfg.train.precision)).lines()))
    print(f"next: grpo iterate {run} --iters N")
