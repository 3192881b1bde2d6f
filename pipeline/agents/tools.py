"""Tools as TRL 1.16 takes them: plain functions (sync or async) with type hints and a Google-style
docstring, their JSON schemas from transformers' `get_json_schema`, and one call of one of them
with a wall-clock timeout whose outcome, whatever it is, becomes the text of a tool message.

    rollout:
      tools: [calc.py:multiply, mypkg.search:lookup, python]

User tools run in the rollout process, as TRL runs them: they can read and write what the
rollout can. Where a call runs and the arguments it gets are pipeline.agents.execution's: a sync
tool on the main thread (so `signal.alarm` works in it, as in TRL), an async one on the process's
event loop, arguments cast to the schema's types as TRL casts them. A call past its timeout is
answered with a timeout error: a sync one is interrupted (Deadline raised inside it); an async
one is cancelled. A tool that raises SystemExit fails the stage with one line; one that kills its
process (os._exit, a signal) takes the stage with it, before its part is written, so a resume
samples that part again.

What a call answers is TRL's tool message content: a list result stays a list (TRL passes it on for
content parts; `grpo_agent.py`'s reward checks `isinstance(result, list)`), anything else is str()
of it; a failure is `str({"error": message})` with the message TRL's call would give (Python's own
text for a wrong argument name: `f() got an unexpected keyword argument 'x'`).
The built-in `python` tool runs the model's code in the reward sandbox (pipeline.rewards.sandbox:
its own process, no network, memory/CPU/process limits) and answers with what it printed.
"""

from __future__ import annotations

import inspect
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

from pipeline.agents.execution import BadArgument, Deadline, EpisodeThread, MainThreadCalls, cast_arguments, episode_calls, \
    parameters, run_async
from pipeline.config.agents import PYTHON_TOOL
from pipeline.errors import GRPOError

PYTHON_TOOL_MEMORY_MB = 512


def python(code: str) -> str:
    """Run Python code in a sandbox and return what it printed (stdout and stderr, the last 2000 characters).

    Args:
        code: The Python source to run; use print() to see values.
    """
    from pipeline.rewards.sandbox import run_python

    # the sandbox keeps the tail of stderr and drops stdout: print to stderr, so both come back
    result = run_python("import sys as _sys\n_sys.stdout = _sys.stderr\n" + code, [], timeout_s=_python_timeout[0],
                        memory_mb=PYTHON_TOOL_MEMORY_MB)
    out = result.stderr_tail
    if result.status == "timeout":
        out += f"\n[timed out after {_python_timeout[0]:g} s]"
    elif result.status == "crashed":
        out += "\n[the process died: a resource limit or os._exit]"
    return out


_python_timeout = [10.0]  # the sandbox's own deadline: rollout.tool_timeout_s, set by load_tools


def _resolve(target: str, label: str) -> Any:
    from pipeline.rewards.contract import resolve

    try:
        return resolve(target)
    except GRPOError as err:
        raise GRPOError(f"{label} {target!r}: {err}") from None


def tool_schema(fn: Callable, label: str) -> dict:
    """{"type": "function", "function": {name, description, parameters}}: what chat templates render."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as err:  # TypeHintParsingException, DocstringParsingException
        msg = str(err).splitlines()[0] if str(err).strip() else type(err).__name__
        raise GRPOError(f"{label}: {msg} (a tool needs type hints on every argument and a Google-style docstring, as TRL requires)") from None


def load_tools(targets: list[str], timeout_s: float = 10.0) -> list[Callable]:
    """The configured tools, each checked (callable, type hints, docstring) as `rollout.tools[i]`."""
    _python_timeout[0] = max(0.5, timeout_s - 0.5)  # the sandbox answers before the call is abandoned
    out = []
    for i, target in enumerate(targets):
        label = f"rollout.tools[{i}]"
        fn = python if target == PYTHON_TOOL else _resolve(target, label)
        if not callable(fn) or inspect.isclass(fn):
            raise GRPOError(f"{label} {target!r}: not a function")
        tool_schema(fn, f"{label} {target!r}")
        out.append(fn)
    names = [f.__name__ for f in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise GRPOError(f"rollout.tools: two tools are named {dup[0]!r}; the model calls tools by name")
    return out


@dataclass
class CallResult:
    content: str
    """The tool message's text: the result, str() of it (of a list too), or TRL's error text."""
    error: str | None
    """None, or: unknown_tool | bad_arguments | raised | timeout | malformed."""
    seconds: float
    value: list | None = None
    """A list result as the tool returned it: TRL's tool message holds it so (what the template
    renders, what reward functions get)."""


def _error_text(message: str) -> str:
    return str({"error": message})  # what TRL puts in the tool message for a failed call


def call_tool(tools: dict[str, Callable], name: str | None, arguments: Any, timeout_s: float,
              thread: MainThreadCalls | EpisodeThread | None = None, properties: dict | None = None) -> CallResult:
    """Run one parsed call: its arguments cast to the schema's types (`properties`: the tool's
    parameters, read from its schema when not given), a sync tool on the episode's `thread` (the
    main thread when none is given and this is it), an async one on the process's event loop (see
    pipeline.agents.execution). Every failure is an answer the model sees, never an exception, but
    for SystemExit / KeyboardInterrupt, which fail the stage (GRPOError)."""
    start = time.perf_counter()

    def done(content, error=None) -> CallResult:
        return CallResult(content, error, round(time.perf_counter() - start, 6))

    if name is None:
        return done(_error_text(f"malformed tool call: {arguments}"), "malformed")
    fn = tools.get(name)
    if fn is None:
        return done(_error_text(f"Tool {name} not found."), "unknown_tool")
    if not isinstance(arguments, dict):
        try:
            fn(**arguments)  # raises before the tool runs, with Python's text, as TRL's call does
        except TypeError as err:
            return done(_error_text(str(err)), "bad_arguments")
    try:
        inspect.signature(fn).bind(**arguments)
        mismatch = False
    except TypeError:
        mismatch = True  # the call raises Python's own text (a wrong or missing name) before the tool runs, as in TRL
    except ValueError:
        mismatch = False  # no signature to check against: the call itself will say
    if not mismatch:
        try:
            arguments = cast_arguments(tool_parameters(fn) if properties is None else properties, arguments)
        except BadArgument as err:
            return done(_error_text(f"{name}: {err}"), "bad_arguments")
    calls = thread if thread is not None else episode_calls(f"grpo-tool-{name}")
    try:
        if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)):
            value = run_async(fn(**arguments), timeout_s)
        else:
            value = calls.run(fn, arguments, timeout_s)
    except Deadline:
        return done(_error_text(f"{name} timed out after {timeout_s:g} s"), "timeout")
    except (SystemExit, KeyboardInterrupt) as err:
        raise GRPOError(f"tool {name!r} tried to end the process ({type(err).__name__} {err}); the stage stops, no part was written") from None
    except Exception as err:
        return done(_error_text(str(err)), "bad_arguments" if mismatch and isinstance(err, TypeError) else "raised")
    finally:
        if thread is None:
            calls.close()
    if isinstance(value, list):  # kept a list, as TRL keeps it (the episode records it exactly: tuples stay tuples)
        return CallResult(str(value), None, round(time.perf_counter() - start, 6), value)
    return done(str(value))


def tool_parameters(fn: Callable) -> dict:
    """The parameters of `fn`'s schema ({} when it has none to read)."""
    try:
        return parameters(tool_schema(fn, "tool"))
    except GRPOError:
        return {}
