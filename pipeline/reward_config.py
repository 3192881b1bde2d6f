"""The `rewards:` list of the config: a discriminated union on `fn`, one model per built-in.

Each built-in has its own typed options (`kwargs`), so a misspelt built-in, an unknown option
or a value of the wrong type is a config error at `grpo init`, naming the key:

    rewards:
      - {fn: correct}                                     # CorrectReward
      - {fn: contains, kwargs: {keyword: important}}      # ContainsReward
      - {fn: my_rewards.py:brevity, kwargs: {limit: 40}}  # CustomReward: any callable

The tag is `fn` itself for a built-in and "custom" for `module:function` / `file.py:function`
(the callable discriminator below). A custom function's kwargs stay a free mapping; its import
and its signature are checked at init by `pipeline.preflight`, which needs the dataset header.
"""

from __future__ import annotations

import difflib
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, ValidationError, model_validator

from pipeline.errors import GRPOError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class _Options(_Section):
    """Options of a built-in reward; `columns()` names the dataset columns it reads."""

    def columns(self) -> list[str]:
        return []


class CorrectOptions(_Options):
    answer_column: str = "answer"
    """Dataset column with the gold answer (GSM8K style: working, then `#### <answer>`)."""

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
    """A Hugging Face sequence-classification model directory (or hub id)."""
    batch_size: int = Field(16, ge=1)
    """Texts per forward pass."""
    label: int | str = 0
    """The logit used: an index, or a name from the model's id2label."""
    sign: Literal[1, -1] = 1
    """-1 turns a "bad" score (toxicity) into a reward."""
    use_prompt: bool = True
    """Score prompt + completion (true) or the completion alone."""
    activation: Literal["none", "sigmoid", "softmax"] = "none"
    """Applied to the logits before the label is taken."""
    max_length: int = Field(512, ge=1)
    """Texts are truncated to this many tokens."""
    device: str = "auto"
    """Torch device; auto picks cuda when available."""


class CodeTestsOptions(_Options):
    tests_column: str = "tests"
    """Dataset column with the row's assert statements (a list, or a JSON string of one)."""
    timeout_s: float = Field(5.0, gt=0.0)
    """Wall-clock limit per sandboxed run."""
    memory_mb: int = Field(256, ge=16)
    """Memory limit per sandboxed run."""
    workers: int | None = Field(None, ge=1)
    """Sandboxes run at once; None: one per CPU core."""

    def columns(self) -> list[str]:
        return [self.tests_column]


class _Reward(_Section):
    weight: float = 1.0
    """Weight in the total reward (weighted sum over the functions that apply, as TRL)."""
    name: str | None = None
    """Column/metric name; defaults to the function's name."""
    rows_per_call: int | None = Field(None, ge=1)
    """Async functions only: call the function on slices of this many rows, concurrently; None: one call with the whole batch (TRL)."""
    max_concurrency: int = Field(8, ge=1, le=1024)
    """Async functions only: calls of this function in flight at once."""
    timeout_s: float = Field(60.0, gt=0.0)
    """Async functions only: limit per call; a call still running then is an error (after retries)."""
    retries: int = Field(2, ge=0, le=10)
    """Async functions only: further attempts after a call raises a transient error (OSError, TimeoutError)."""

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
        return self.kwargs.columns() if isinstance(self.kwargs, _Options) else []


def _opts(model):
    return Field(default_factory=dict, validate_default=True, description=model.__doc__)


class CorrectReward(_Reward):
    """1 when the last <answer> block equals the gold answer (math-verify, see pipeline.answers)."""

    fn: Literal["correct"]
    """Built-in `correct`."""
    kwargs: CorrectOptions = _opts(CorrectOptions)
    """Options of `correct`."""


class FormatReward(_Reward):
    """1 for exactly <think>...</think><answer>...</answer>, 0.5 for only an answer block."""

    fn: Literal["format"]
    """Built-in `format`."""
    kwargs: FormatOptions = _opts(FormatOptions)
    """Options of `format` (none)."""


class ContainsReward(_Reward):
    """`value` if `keyword` occurs in the completion."""

    fn: Literal["contains"]
    """Built-in `contains`."""
    kwargs: ContainsOptions = _opts(ContainsOptions)
    """Options of `contains`."""


class LengthRangeReward(_Reward):
    """`value` if the completion's length is within [min_tokens, max_tokens]."""

    fn: Literal["length_range"]
    """Built-in `length_range`."""
    kwargs: LengthRangeOptions = _opts(LengthRangeOptions)
    """Options of `length_range`."""


class OverlongReward(_Reward):
    """DAPO's soft overlong punishment."""

    fn: Literal["overlong"]
    """Built-in `overlong`."""
    kwargs: OverlongOptions = _opts(OverlongOptions)
    """Options of `overlong`."""


class RewardModelReward(_Reward):
    """A frozen sequence-classification model's logit (or probability)."""

    fn: Literal["reward_model"]
    """Built-in `reward_model`."""
    kwargs: RewardModelOptions = _opts(RewardModelOptions)
    """Options of `reward_model`."""


class CodeTestsReward(_Reward):
    """Fraction of the row's assert-style tests the completion's code passes (sandboxed)."""

    fn: Literal["code_tests"]
    """Built-in `code_tests`."""
    kwargs: CodeTestsOptions = _opts(CodeTestsOptions)
    """Options of `code_tests`."""


class CustomReward(_Reward):
    """Your function in TRL's contract, `module:function` or `path/to/file.py:function`."""

    fn: str = Field(pattern=r"^[^:]+:[^:]+$")
    """`module:function` (imported from the current directory or the environment) or `path/to/file.py:function`."""
    kwargs: dict[str, Any] = {}
    """Keyword arguments passed on every call (they win over a dataset column of the same name)."""


BUILTIN_MODELS: dict[str, type[_Reward]] = {
    "correct": CorrectReward,
    "format": FormatReward,
    "contains": ContainsReward,
    "length_range": LengthRangeReward,
    "overlong": OverlongReward,
    "reward_model": RewardModelReward,
    "code_tests": CodeTestsReward,
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


def reward_spec(tree: dict | Any, index: int = 0) -> Any:
    """Validate one `rewards:` entry outside a whole config (tests, tools); GRPOError naming the key."""
    from pipeline.config import format_error  # config imports this module: late import, no cycle at load

    if isinstance(tree, _Reward):
        return tree
    try:
        return _ADAPTER.validate_python(tree)
    except ValidationError as err:
        raise GRPOError(format_error(err, "rewards", prefix=("rewards", index))) from None
