"""The rollout options of multi-turn episodes (tools, environments), kept beside the agents
package and mixed into `pipeline.config.RolloutConfig` (whose keys they are: `rollout.tools`, ...)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from pipeline.config.base import Section

PYTHON_TOOL = "python"
"""The built-in code interpreter tool: runs the model's code in the reward sandbox (pipeline.rewards.sandbox)."""


class VerifiersOptions(Section):
    """A verifiers (0.4, v1 API) environment run per episode against grpo's endpoint by grpo's own
    agent program (pipeline/agents/endpoint/vf_episode.py; docs/agents.md, "verifiers")."""

    taskset: str = Field(min_length=1)
    """The taskset's id as `vf-eval` takes it: a module exporting one Taskset via `__all__`."""
    taskset_args: dict = {}
    """The taskset's config fields (`--env.taskset.*`), e.g. {num_tasks: 8}."""
    env: str = ""
    """An Env id pairing the taskset (`--env.id`); empty: the taskset's own, else verifiers' SingleAgentEnv."""
    harness: str | None = "null"
    """The agent's harness id (`--env.agent.harness.id`): `null` (a tool-less chat loop) or `bash`;
    None: the taskset's default."""
    runtime: str = "subprocess"
    """Where the harness runs (`--env.agent.runtime.type`): a local runtime; a remote one cannot reach grpo's endpoint."""
    python: str = "python"
    """The interpreter with verifiers installed (`python`: grpo's own, with the `verifiers` extra)."""
    path: str | None = None
    """A folder put first on the program's PYTHONPATH, where the taskset's package lies (None: installed)."""
    client: Literal["eval", "train"] = "eval"
    """verifiers' client the episode's model calls go through (`--client.type`). eval: the chat route, each
    chat body relayed as sent and rendered by grpo with the run's chat template and tool format; train:
    the tokens route (`/inference/v1/generate`), verifiers' `renderers` package rendering the token ids
    itself (with the tokenizer grpo samples with, GRPO_TOKENIZER) and bridging each turn onto the last,
    grpo checking that each request extends the episode's recorded ids exactly."""
    renderer: dict | None = None
    """With client train: the renderers package's RendererConfig (`--client.renderer`), e.g.
    {name: default, tool_parser: hermes}; None: auto, resolved from the tokenizer (for a model not in
    renderers' map its default renderer: the chat template, no tool parser, so tools are refused)."""

    @field_validator("runtime")
    @classmethod
    def _local(cls, v):
        if v != "subprocess":
            raise ValueError(f"{v!r}: only the local `subprocess` runtime reaches grpo's loopback endpoint (a remote sandbox "
                             "cannot; verifiers' container runtimes are not supported yet)")
        return v


class AgentCommand(Section):
    """An agent program behind grpo's OpenAI-compatible endpoint (pipeline/agents/endpoint)."""

    command: list[str] | None = Field(None, min_length=1)
    """The program and its arguments, e.g. `[python, agent.py]` (`python`/`python3` is the
    interpreter running grpo). Started once per episode, in the directory grpo runs in, with
    OPENAI_BASE_URL, OPENAI_API_KEY (the episode's key), GRPO_MODEL (the model name to ask for),
    GRPO_TASK (the prompt row as JSON), GRPO_SEED and GRPO_RESULT_FILE (a path where it may write
    {"reward": x, "metrics": {...}}: the reward `agent` and its metric columns, pipeline/agents/endpoint/result.py)
    in its environment."""
    timeout_s: float = Field(300.0, gt=0.0)
    """Seconds of the agent's own time per episode: its clock stops while a turn or a side call of its
    waits for the engine (and for the other episodes' requests that share the engine call), so a busy
    engine never times an agent out; a retry (answered at once) or a refused request does not stop it,
    so no loop of them outlives it. An agent still running past it is killed (ending agent_timeout)."""
    max_side_calls: int | None = Field(100, ge=0)
    """At most this many side calls (requests for another model, answered and recorded, never trained
    on) per episode; the next are refused (side_refused), so a harness looping on them is timed out
    by its own clock. null: no bound (runs made before this option)."""
    max_running: int | None = Field(None, ge=1)
    """At most this many agents of a part run at once (null: all of them); the others start in the
    part's order as earlier ones end, so which share an engine call never depends on timing. Bounds
    the processes (each ~70 MB, ~0.8 CPU s to import openai) on a small machine."""
    verifiers: VerifiersOptions | None = None
    """Instead of `command`: a verifiers environment, each episode run by grpo's program for it."""

    @model_validator(mode="after")
    def _one(self):
        if (self.command is None) == (self.verifiers is None):
            raise ValueError("rollout.agent needs exactly one of `command` (an agent program) and `verifiers` (an environment)")
        return self


class AgentOptions(Section):

    tools: list[str] = []
    """Tools the model may call, as TRL takes them: `path/file.py:function`, `module:function`
    (plain functions, sync or async, with type hints and a docstring) or the built-in `python`
    (a code interpreter run in the sandbox). Empty with no environment: one plain completion per sample."""
    environment: str | dict[str, str] | None = None
    """`path/file.py:Class` or `module:Class`: TRL's environment_factory; or a mapping name ->
    class (TRL's dict factory), each row served by the one its `environment` column names.
    Instances are pooled (one per concurrent episode, reused with reset); reset(**dataset_row) may
    return an observation appended to the last user message (the whole prompt when the dataset has
    no prompt column); public methods are tools; reward functions get the instances as
    `environments`; a class's get_reward becomes a reward named after it (pipeline.agents.environment)."""
    max_turns: int | None = Field(4, ge=1, le=256)
    """Model turns per episode at most (TRL's max_tool_calling_iterations + 1): calls made in the
    last allowed turn are recorded but not run (ending max_turns). null: unlimited, TRL's default
    (max_tool_calling_iterations None); the episode is then bounded by max_episode_tokens, which
    must be set."""
    max_episode_tokens: int | None = Field(None, ge=1)
    """Tokens after the prompt per episode at most (model turns, tool results, template glue);
    None = max_turns x max_new_tokens. A turn is cut to what is left; tool results that would pass it
    are left out and end the episode (ending max_episode_tokens), as TRL drops them; results that
    fill it exactly are kept and end it too."""
    tool_timeout_s: float = Field(10.0, gt=0.0)
    """Wall-clock seconds per tool call; a call past it is answered with a timeout error the model sees."""
    tool_format: Literal["auto", "hermes"] = "auto"
    """How tools reach the prompt and calls are parsed. auto: the chat template's own tool support
    (tools=, assistant tool_calls, tool messages; calls parsed by the tokenizer's response_template
    or the template's <tool_call> JSON), falling back to hermes when the template renders no tool
    calls; hermes: the Hermes/Qwen format in plain messages whatever the template: the tool
    signatures in the system message, calls as <tool_call>{"name": ..., "arguments": {...}}</tool_call>,
    results as user messages <tool_response>...</tool_response>."""

    agent: AgentCommand | None = None
    """An agent program that talks to the model through an OpenAI-compatible endpoint grpo serves
    over its warm engine (docs/agents.md, "Agents behind an endpoint"), instead of `tools` /
    `environment`; max_turns and max_episode_tokens bound its episodes as they bound tool episodes."""

    @field_validator("environment")
    @classmethod
    def _names(cls, v):
        if isinstance(v, dict) and (not v or not all(isinstance(k, str) and k for k in v)):
            raise ValueError("a mapping of environment names (the `environment` column's values) to classes, at least one")
        return v

    @model_validator(mode="after")
    def _bounded(self):
        if self.max_turns is None and self.max_episode_tokens is None:
            raise ValueError("rollout.max_turns null (unlimited turns) needs rollout.max_episode_tokens to bound each episode, "
                             "as TRL's max_completion_length does")
        if self.agent is not None and (self.tools or self.environment is not None):
            raise ValueError("rollout.agent runs its own tools behind the endpoint; it cannot be combined with "
                             "rollout.tools or rollout.environment")
        return self

    @property
    def agentic(self) -> bool:
        """Whether samples are multi-turn episodes (tools, an environment or an endpoint agent)."""
        return bool(self.tools) or self.environment is not None or self.agent is not None

    def episode_tokens(self) -> int:
        return self.max_episode_tokens or self.max_turns * self.max_new_tokens  # type: ignore[attr-defined]


AGENT_NEUTRAL = {
    ("rollout", "tools"): [],
    ("rollout", "environment"): None,
    ("rollout", "max_turns"): 4,
    ("rollout", "max_episode_tokens"): None,
    ("rollout", "tool_timeout_s"): 10.0,
    ("rollout", "tool_format"): "auto",
    ("rollout", "agent"): None,
    ("rollout", "agent", "max_running"): None,  # every agent of a part at once, as before
    ("rollout", "agent", "max_side_calls"): None,  # side calls unbounded, as before
    ("rollout", "agent", "verifiers"): None,  # after ("rollout", "agent"): a run without an agent keeps agent null
    ("rollout", "agent", "verifiers", "client"): "eval",  # the chat route, as verifiers runs did before the tokens route
    ("rollout", "agent", "verifiers", "renderer"): None,
}
"""Their values in runs made before them (no tools: a single completion), for config.ADDED_OPTIONS."""
