"""What `grpo init` checks before it writes anything: the mistakes that would otherwise surface
only in `grpo score`, after a rollout has run.

The config tree itself is validated by pydantic (built-in names, their options, eval.reward).
Here, with the dataset's header in hand:
  - data.train / data.eval exist, can be read, and have the prompt column (or the columns
    data.prompt_template names);
  - every custom reward function imports (from the copy the run will hold, as the stages import it:
    an import or a data file that only the current directory has is refused here), is callable, and its signature accepts what TRL
    passes it: prompts, completions, completion_ids, trainer_state, log_metric, log_extra and
    every dataset column (so either **kwargs or each of them by name); an argument it asks
    for without a default must be one of those or a `kwargs` option;
  - the column a built-in reads by name (correct's answer_column, code_tests' tests_column) or a
    judge's rubric names is in data.train and every eval set; a dotted path (`reward_model.ground_truth`)
    must name a field of a struct column or nested JSON object there (pipeline.data.fields);
  - with rollout.tools / rollout.environment (pipeline.agents.setup): every tool imports and has
    type hints and a docstring, the environment class has reset, and the model's chat template
    (or the Hermes fallback) can express a tool exchange;
  - on a GPU machine, that vLLM and the trainer each fit on one GPU (pipeline.models.device_budget;
    the split of one GPU between them in `iterate` is checked when it starts, before any engine
    loads, since separate stage commands never share it). A CPU machine cannot know the GPU.
Each failure is one GRPOError line naming the key and the file.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from pipeline.config import Config
from pipeline.data import fields
from pipeline.data.prompts import dataset_columns, prompt_columns
from pipeline.errors import GRPOError
from pipeline.rewards.contract import TRL_ARGS, load_reward, other_contract
from pipeline.rewards.loading import code_as_held
from pipeline.config.rewards import CustomReward


def check_signature(fn, label: str, target: str, columns: list[str]) -> None:
    """`fn` (a partial with the config's kwargs bound) accepts TRL's call with these columns."""
    try:
        params = inspect.signature(fn.func).parameters
    except (TypeError, ValueError):
        return  # a builtin or C callable without a signature: nothing to check
    bound = set(fn.keywords)
    passed = set(TRL_ARGS) | set(columns) | bound
    where = f"{label}.fn {target!r}"
    for p in params.values():
        if p.kind is p.POSITIONAL_ONLY and p.default is p.empty:
            raise GRPOError(f"{where}: argument {p.name!r} is positional-only; TRL passes every argument by keyword")
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty and p.name not in passed:
            raise GRPOError(
                f"{where}: asks for {p.name!r}, which is no TRL argument, no kwargs option and no dataset column "
                f"(columns: {', '.join(columns)})"
            )
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        missing = [a for a in [*TRL_ARGS, *columns, *sorted(bound)] if a not in params]
        if missing:
            raise GRPOError(
                f"{where}: does not accept {missing[0]!r}, which it would be passed "
                "(TRL passes every reward function its arguments and every dataset column); add **kwargs"
            )


def check(cfg: Config, judges_reachable: bool = True) -> list[str]:
    """Every check above, in config order; raises the first failure. Returns notes for the user
    (a tool format that fell back). `judges_reachable`: ask each served reward's server one cheap
    request (pipeline/rewards/judge/check.py). Reward, tool and environment code is imported from
    the copies the run will hold, as every stage imports it (pipeline.rewards.loading.code_as_held)."""
    with code_as_held(cfg):
        return _check(cfg, judges_reachable)


def _check(cfg: Config, judges_reachable: bool) -> list[str]:
    train_columns = _checked_columns(cfg, cfg.data.train, "data.train")
    sets = [(cfg.data.train, train_columns, "data.train")]  # (path, columns, key): where a column named in config must be
    for s in cfg.eval_sets():
        key = "data.eval" if s.name is None else f"data.eval.{s.name}"
        sets.append((s.path, _checked_columns(cfg, s.path, key), key))
    reserved = [c for c in train_columns if c in ("prompts", "completions", "completion_ids", *TRL_ARGS)]
    if reserved:
        raise GRPOError(f"data.train {cfg.data.train}: column {reserved[0]!r} clashes with the reward-function argument of that name; rename it")
    columns = [c for c in train_columns if c != cfg.data.prompt_column]
    if cfg.rollout.environment is not None:
        columns.append("environments")  # TRL passes the episodes' environment instances
    for j, spec in enumerate(cfg.rewards):
        fn = load_reward(spec, index=j)  # imports a custom function: a missing file or name fails here
        if spec.served:  # a judge, a served reward model: its key, its rubric's columns, its server
            from pipeline.rewards.judge.check import check_served

            check_served(spec.kwargs, f"rewards[{j}]", sets, judges_reachable)
        if (other := other_contract(spec)) is not None:
            other.check_signature(fn, f"rewards[{j}]", spec.fn, train_columns, cfg.data.train)
        elif isinstance(spec, CustomReward):
            check_signature(fn, f"rewards[{j}]", spec.fn, columns)
        for option, column in _column_options(spec):  # in data.train and every eval set (eval scores with the same rewards)
            for data, have, key in sets:
                fields.check(data, have, column, f"rewards[{j}].kwargs.{option}: {key}")
    check_device(cfg)
    if cfg.rollout.agentic:
        from pipeline.agents.setup import check as check_agents

        note = check_agents(cfg)
        return [note] if note else []
    return []


def check_device(cfg: Config, device=None) -> None:
    """On a GPU (`device`, default this machine's): the engine alone and the trainer alone fit."""
    from pipeline.models import device_budget as dp
    from pipeline.run.policy import policy_kind

    if device is None and not dp.may_have_gpu():  # no NVIDIA driver: no GPU, and no torch import at init
        return
    device = device or dp.this_device()
    model = Path(cfg.model)
    if not device.cuda or not (model / "config.json").is_file():  # a GGUF file is converted after init
        return
    from pipeline.models.engines import model_context
    from pipeline.rollout import engine_max_len

    if cfg.rollout.engine == "vllm":
        dp.engine_settings_for(cfg.rollout, model, engine_max_len(cfg, model_context(model)), cfg.train.precision, device)
    dp.check_trainer(dp.trainer_bytes(dp.ModelShape.from_dir(model), policy_kind(cfg), device)[1], device)


def _column_options(spec) -> list[tuple[str, str]]:
    names = spec.columns()
    options = spec.options()
    return [(k, v) for k, v in options.items() if v in names and k.endswith("_column")]


def _checked_columns(cfg: Config, path: str, key: str) -> list[str]:
    try:
        columns = dataset_columns(path)
    except GRPOError as err:
        raise GRPOError(f"{key}: {err}") from None
    prompt_head = fields.split(cfg.data.prompt_column, columns)[0]  # the prompt column may be a dotted path into one
    template = cfg.data.prompt_template is not None and prompt_head not in columns
    for column in prompt_columns(cfg.data, columns if prompt_head not in columns else [*columns, cfg.data.prompt_column],
                                 environment=cfg.rollout.environment is not None):
        fix = "data.prompt_template" if cfg.data.prompt_template is not None else "data.prompt_column"
        if fields.split(column, columns)[0] not in columns:
            raise GRPOError(f"{key} {path}: no column {column!r} (columns: {', '.join(columns)}); set {fix}")
        # a template's field, or the prompt column, may be a dotted path into a column: the key it names must be there
        fields.check(path, columns, column, f"data.prompt_template {{{column}}}: {key}" if template else f"data.prompt_column: {key}")
    if cfg.data.prompt_column not in columns:
        columns = [*columns, cfg.data.prompt_column]  # built by the template
    return columns
