"""The `rewards:` list of the config: a discriminated union on `fn`, one model per built-in.

Each built-in has its own typed options (`kwargs`), so a misspelt built-in, an unknown option
or a value of the wrong type is a config error at `grpo init`, naming the key:

    rewards:
      - {fn: correct}                                     # CorrectReward
      - {fn: contains, kwargs: {keyword: important}}      # ContainsReward
      - {fn: my_rewards.py:brevity, kwargs: {limit: 40}}  # CustomReward: any callable

Each built-in's model is made by `_builtin` from its options model (the table BUILTIN_MODELS).
The tag is `fn` itself for a built-in and "custom" for `module:function` / `file.py:function`
(the callable discriminator below). A custom function's kwargs stay a free mapping; its import
and its signature are checked at init by `pipeline.preflight`, which needs the dataset header.
"""

from __future__ import annotations

import difflib
import math
from typing import Annotated, Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, ValidationInfo, create_model, field_validator,
                      model_validator)

from pipeline.config.base import Section
from pipeline.config.judge import JudgeOptions


class _Options(Section):
    """Options of a built-in reward; `columns()` names the dataset columns it reads."""

    def columns(self) -> list[str]:
        return []


class CorrectOptions(_Options):
    answer_column: str = "answer"
    """Dataset column with the gold answer (GSM8K style: working, then `#### <answer>`; or the bare answer); a dotted path names a field of a struct column (verl's `reward_model.ground_truth`)."""

    def columns(self) -> list[str]:
        return [self.answer_column]


class FormatOptions(_Options):
    """`format` has no options."""


class ContainsOptions(_Options):
    keyword: str = Field(min_length=1)
    """The text to look for in the completion."""
    value: float = 1.0
    """Reward when the keyword occurs (0.0 otherwise)."""
    case_sensitive: bool = False
    """Match case exactly."""


class LengthRangeOptions(_Options):
    min_tokens: int = Field(0, ge=0)
    """Shortest length that earns `value`."""
    max_tokens: int | None = Field(None, ge=0)
    """Longest length that earns `value`; None: no upper bound."""
    value: float = 1.0
    """Reward inside the range (0.0 outside)."""
    unit: Literal["tokens", "words"] = "tokens"
    """Count completion tokens, or whitespace-separated words."""


class OverlongOptions(_Options):
    max_tokens: int = Field(ge=1)
    """DAPO's L_max: longer completions get -1."""
    buffer: int = Field(ge=1)
    """DAPO's L_cache: the linear ramp from 0 to -1 spans the last `buffer` tokens before max_tokens."""

    @model_validator(mode="after")
    def _buffer_fits(self) -> "OverlongOptions":
        if self.buffer > self.max_tokens:
            raise ValueError(f"need buffer <= max_tokens, got buffer={self.buffer}, max_tokens={self.max_tokens}")
        return self


class RewardModelOptions(_Options):
    model: str
    """A Hugging Face sequence-classification model directory (or hub id); with base_url: the name the server serves it under."""
    base_url: str | None = None
    """A served model: its OpenAI-compatible server up to /v1 (`vllm serve MODEL --runner pooling`); each text is sent to the server's /classify. None: the model runs in the score process. A secret in it is written `${NAME}` (read from the environment, never stored)."""
    api_key_env: str | None = None
    """Served: the NAME of the environment variable holding the API key (sent as a Bearer token); the key is never stored."""
    on_failure: Literal["error", "none"] = "error"
    """Served: a request still failing after its retries stops the stage (answers so far are kept), or gives that completion None."""
    batch_size: int = Field(16, ge=1)
    """In-process: texts per forward pass."""
    label: int | str = 0
    """The logit used: an index, or a name from the model's id2label (in-process only: a server does not report label names)."""
    sign: Literal[1, -1] = 1
    """-1 turns a "bad" score (toxicity) into a reward."""
    use_prompt: bool = True
    """Score prompt + completion (true) or the completion alone."""
    activation: Literal["none", "sigmoid", "softmax"] = "none"
    """Applied to the logits before the label is taken."""
    max_length: int = Field(512, ge=1)
    """Texts are truncated to this many tokens (served: at most the server's --max-model-len)."""
    device: str = "auto"
    """In-process: torch device; auto picks cuda when available."""

    @field_validator("base_url")
    @classmethod
    def _no_secret_written(cls, value: str | None, info: ValidationInfo) -> str | None:
        from pipeline.config.urls import checked

        return value if value is None else checked(value, info.context)

    @field_validator("api_key_env")
    @classmethod
    def _key_of_a_server(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("base_url") is None:
            raise ValueError("names the key of a served model: set base_url too")
        return value

    @field_validator("label")
    @classmethod
    def _served_label(cls, value: int | str, info: ValidationInfo) -> int | str:
        if isinstance(value, int) and value < 0:
            raise ValueError(f"{value} is no logit index (0, 1, ...)")
        if isinstance(value, str) and info.data.get("base_url") is not None:
            raise ValueError(f"{value!r}: a served model's label is a logit index (its server reports no label names)")
        return value

    @property
    def served(self) -> bool:
        """Asked over HTTP, its answers recorded (pipeline.rewards.judge.served_rewards), or run in-process."""
        return self.base_url is not None


class OpenRLHFServerOptions(_Options):
    url: str
    """The reward server's endpoint, as given to OpenRLHF's --remote_rm_url (`openrlhf.cli.serve_rm` serves http://HOST:5000/get_reward); each completion is one POST of {query, prompts, labels} to it. A secret in it (`?key=`, a user:password) is written `${NAME}`, read from that environment variable where each request is sent and never stored."""
    label_key: str | None = None
    """Dataset column sent as `labels` (OpenRLHF's --label_key); None: null labels."""
    api_key_env: str | None = None
    """The NAME of the environment variable holding a key sent as a Bearer token (OpenRLHF's server needs none); the key is never stored."""
    on_failure: Literal["error", "none"] = "error"
    """A request still failing after its retries stops the stage (answers so far are kept), or gives that completion None."""

    @field_validator("url")
    @classmethod
    def _an_http_url(cls, value: str, info: ValidationInfo) -> str:
        from urllib.parse import urlsplit

        from pipeline.config.urls import REF, checked

        bare = REF.sub("0", value)  # a ${NAME} reference stands for a value (pipeline/config/urls.py)
        try:
            parts = urlsplit(bare)
            parts.port  # noqa: B018 (raises on a port that is not a number)
        except ValueError:
            parts = None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or any(c.isspace() for c in bare):
            raise ValueError(f"{value!r} is not an http(s) URL (e.g. http://127.0.0.1:5000/get_reward)")
        return checked(value, info.context)

    @property
    def served(self) -> bool:
        """Always asked over HTTP, its answers recorded (pipeline.rewards.judge.served_rewards)."""
        return True

    def columns(self) -> list[str]:
        return [self.label_key] if self.label_key is not None else []


class CodeTestsOptions(_Options):
    tests_column: str = "tests"
    """Dataset column with the row's assert statements (a list, or a JSON string of one); a dotted path names a field of a struct column."""
    timeout_s: float = Field(5.0, gt=0.0)
    """Wall-clock limit per sandboxed run."""
    memory_mb: int = Field(256, ge=16)
    """Memory limit per sandboxed run."""
    workers: int | None = Field(None, ge=1)
    """Sandboxes run at once; None: one per CPU core."""

    def columns(self) -> list[str]:
        return [self.tests_column]


class _Reward(Section):
    weight: float = 1.0
    """Weight in the total reward (weighted sum over the functions that apply, as TRL)."""
    name: str | None = None
    """Column/metric name; defaults to the function's name."""
    rows_per_call: int | None = Field(None, ge=1)
    """Async functions only: call the function on slices of this many rows, concurrently; None: one call with the whole batch (TRL)."""
    max_concurrency: int = Field(8, ge=1, le=1024)
    """Async functions and served rewards (`judge`, a served `reward_model`, `openrlhf_server`): calls (served: requests) of this function in flight at once, per scoring process (N shard workers or Ray score tasks: up to N times this)."""
    timeout_s: float = Field(60.0, gt=0.0)
    """Async functions and served rewards: limit per call (served: per request); a call still running then is an error (after retries)."""
    retries: int = Field(2, ge=0, le=10)
    """Async functions and served rewards: further attempts after a transient error (OSError, TimeoutError; served: as the openai client, also HTTP 408, 409, 429, 5xx and x-should-retry, waiting retry-after up to 60 s, else exponential backoff)."""
    range: tuple[float, float] | None = None
    """[lo, hi], the values the function can give (lo < hi, both finite): eval's intervals of its figures (`rewards/<name>`, and `reward` when every reward's range is known) take their span from it, and a value outside it stops the score stage, naming the reward and the row. None: a built-in's range where its definition gives one (correct, format, code_tests [0, 1]; contains, length_range [0, value]; overlong [-1, 0]; a judge's verdict; a reward model's sigmoid or softmax), else the range it took over the run's scored samples and the eval's; where the run scored nothing yet, the eval's samples' range widened, and no interval below 7 prompts or where every sample is one value (docs/tracking.md, bench/results.md: eval intervals)."""

    @field_validator("range")
    @classmethod
    def _a_range(cls, value: tuple[float, float] | None) -> tuple[float, float] | None:
        if value is not None and not (math.isfinite(value[0]) and math.isfinite(value[1]) and value[0] < value[1]):
            raise ValueError(f"[{value[0]}, {value[1]}] is no range: need [lo, hi] with lo < hi, both finite")
        return value

    @property
    def column(self) -> str:
        base = self.name or self.fn.rsplit(":", 1)[-1]
        return base.replace("/", "_").replace(".", "_")

    def options(self) -> dict[str, Any]:
        """The keyword arguments bound to the function on every call."""
        kwargs = self.kwargs
        return kwargs.model_dump() if isinstance(kwargs, BaseModel) else dict(kwargs)

    def columns(self) -> list[str]:
        """Dataset columns a built-in reads by name (custom functions: see preflight)."""
        return self.kwargs.columns() if isinstance(self.kwargs, _Options | JudgeOptions) else []

    @property
    def served(self) -> bool:
        """Asked over HTTP with every request and answer recorded: `judge`, a `reward_model` with base_url."""
        return bool(getattr(self.kwargs, "served", False))


def _builtin(fn: str, options: type[_Options], doc: str) -> type[_Reward]:
    """The config model of built-in `fn`: the common fields, `fn: Literal[fn]`, typed `kwargs`."""
    return create_model(
        "".join(w.title() for w in fn.split("_")) + "Reward",
        __base__=_Reward,
        __doc__=doc,
        fn=(Literal[fn], Field(description=f"Built-in `{fn}`.")),
        # {} validated by default: a missing required option is named (rewards.0.kwargs.keyword)
        kwargs=(options, Field(default_factory=dict, validate_default=True, description=f"Options of `{fn}`.")),
    )


class CustomReward(_Reward):
    """Your function in TRL's contract, `module:function` or `path/to/file.py:function`."""

    fn: str = Field(pattern=r"^[^:]+:[^:]+$")
    """`module:function` (imported from the current directory or the environment) or `path/to/file.py:function`."""
    kwargs: dict[str, Any] = {}
    """Keyword arguments passed on every call (they win over a dataset column of the same name)."""
    contract: Literal["trl", "openrlhf", "verl"] = "trl"
    """How it is called: `trl` (TRL's reward contract) or `openrlhf` (OpenRLHF's `reward_func(queries, prompts, labels)`; `kwargs.label_key` names the labels' column; pipeline/rewards/openrlhf.py) or `verl` (verl's `compute_score(data_source, solution_str, ground_truth, extra_info=None)`, ground_truth from the `reward_model` column; pipeline/rewards/verl.py)."""


BUILTIN_MODELS: dict[str, type[_Reward]] = {
    "correct": _builtin("correct", CorrectOptions, "1 when the last <answer> block equals the gold answer (math-verify)."),
    "format": _builtin("format", FormatOptions, "1 for exactly <think>...</think><answer>...</answer>, 0.5 for only an answer block."),
    "contains": _builtin("contains", ContainsOptions, "`value` if `keyword` occurs in the completion."),
    "length_range": _builtin("length_range", LengthRangeOptions, "`value` if the completion's length is within [min_tokens, max_tokens]."),
    "overlong": _builtin("overlong", OverlongOptions, "DAPO's soft overlong punishment."),
    "reward_model": _builtin("reward_model", RewardModelOptions, "A frozen sequence-classification model's logit (or probability), in-process or served (vLLM's pooling server)."),
    "code_tests": _builtin("code_tests", CodeTestsOptions, "Fraction of the row's assert-style tests the completion's code passes (sandboxed)."),
    "judge": _builtin("judge", JudgeOptions, "An LLM judge behind an OpenAI-compatible server, reading a rubric (pipeline/rewards/judge)."),
    "openrlhf_server": _builtin("openrlhf_server", OpenRLHFServerOptions, "A reward server speaking OpenRLHF's protocol, POST {query, prompts, labels} -> {rewards} (pipeline/rewards/judge/openrlhf_server.py)."),
}
CUSTOM = "custom"


def _tag(value: Any) -> str | None:
    fn = value.get("fn") if isinstance(value, dict) else getattr(value, "fn", None)
    if not isinstance(fn, str):
        return None
    if fn in BUILTIN_MODELS:
        return fn
    return CUSTOM if ":" in fn else fn  # an unknown tag: pydantic reports union_tag_invalid


RewardSpec = Annotated[
    Union[tuple(Annotated[m, Tag(t)] for t, m in BUILTIN_MODELS.items()) + (Annotated[CustomReward, Tag(CUSTOM)],)],  # noqa: UP007
    Discriminator(_tag),
]
"""One entry of `rewards:`; the built-in or custom model chosen by `fn`."""

TAGS = set(BUILTIN_MODELS) | {CUSTOM}


def unknown_fn_message(fn: Any) -> str:
    """The one line for a `fn` that is neither a built-in nor module:function."""
    close = difflib.get_close_matches(str(fn), list(BUILTIN_MODELS), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return (f"{fn!r} is not a built-in reward (built-ins: {', '.join(BUILTIN_MODELS)}){hint} "
            "A custom one is module:function or path/to/file.py:function")


_ADAPTER = TypeAdapter(RewardSpec)


def validate_reward(tree: dict | Any, stored: bool = False) -> Any:
    """One `rewards:` entry validated alone; pydantic's ValidationError on failure
    (`pipeline.config.errors.reward_spec` turns it into the one line naming the key). `stored`: one a
    run wrote (a manifest's), read as it was (pipeline/config/urls.py `checked`)."""
    if isinstance(tree, _Reward):
        return tree
    return _ADAPTER.validate_python(tree, context={"stored": stored})
