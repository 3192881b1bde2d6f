"""Multi-turn episodes with tools and environments (pipeline/agents): call parsing, tool outcomes,
the token record (sampled tokens kept, glue and results under mask 0), endings, environments
as TRL's environment_factory, bad input at `grpo init`, and on SmolLM2 (whose template has no
tool support: the Hermes fallback) real tool calls: determinism across shards, scoring on the
conversation, replay without calling any tool, audit of a tampered tool result."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import textwrap
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import base_config, grpo, write_config

TOOLS = '''
import os, time


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    log = os.environ.get("CALC_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{a}*{b}\\n")
    return a * b


def explode(x: int) -> int:
    """Always fails.

    Args:
        x: Anything.
    """
    raise ValueError(f"no {x}")


def hang(x: int) -> int:
    """Never answers in time.

    Args:
        x: Anything.
    """
    time.sleep(3)
    return x


def no_hints(a, b):
    """Adds.

    Args:
        a: one
        b: two
    """
    return a + b


def no_doc(a: int) -> int:
    return a


class Counter:
    """A TRL-style environment: a hidden number to find."""

    def reset(self, **row):
        self.target = len(row["prompt"][-1]["content"]) if isinstance(row["prompt"], list) else len(row["prompt"])
        self.guesses = []
        return " (env ready)"

    def guess(self, n: int) -> str:
        """Guess the hidden number.

        Args:
            n: The guess.
        """
        self.guesses.append(n)
        return "yes" if n == self.target else "no"


class NoReset:
    def guess(self, n: int) -> str:
        """Guess.

        Args:
            n: The guess.
        """
        return "no"
'''


def call_text(name, args) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


@pytest.fixture(scope="module")
def tools_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("agent-tools") / "agent_tools.py"
    path.write_text(TOOLS)
    return path


# ------------------------------------------------------------------------- parsing and calling
def test_parse_hermes_calls():
    from pipeline.agents.format import parse_hermes

    content, calls = parse_hermes("Let me compute.\n" + call_text("multiply", {"a": 2, "b": 3}) + call_text("f", {}))
    assert content == "Let me compute." and [(c.name, c.arguments) for c in calls] == [("multiply", {"a": 2, "b": 3}), ("f", {})]
    _, calls = parse_hermes('<tool_call>{"name": "m", "arguments": "{\\"a\\": 1}"}</tool_call>')  # arguments as a JSON string
    assert [(c.name, c.arguments) for c in calls] == [("m", {"a": 1})]
    _, calls = parse_hermes("<tool_call>{not json}</tool_call><tool_call>[1]</tool_call><tool_call>{\"name\": \"m\"")
    assert [c.name for c in calls] == [None, None, None]  # malformed, no name, unterminated
    assert parse_hermes("no call here") == ("no call here", [])


def test_tool_call_outcomes(tools_file, tmp_path, monkeypatch):
    from pipeline.agents.tools import call_tool, load_tools
    from pipeline.errors import GRPOError

    monkeypatch.setenv("CALC_LOG", str(tmp_path / "calls.log"))
    fns = {f.__name__: f for f in load_tools([f"{tools_file}:multiply", f"{tools_file}:explode", f"{tools_file}:hang"])}

    async def aplus(a: int) -> int:
        return a + 1

    fns["aplus"] = aplus
    ok = call_tool(fns, "multiply", {"a": 6, "b": 7}, 1.0)
    assert (ok.content, ok.error) == ("42", None)
    assert (tmp_path / "calls.log").read_text() == "6*7\n"
    assert call_tool(fns, "aplus", {"a": 1}, 1.0).content == "2"
    assert call_tool(fns, "nope", {}, 1.0).error == "unknown_tool"
    assert call_tool(fns, None, "{bad", 1.0).error == "malformed"
    bad = call_tool(fns, "multiply", {"a": 1}, 1.0)
    assert bad.error == "bad_arguments" and "missing a required argument: 'b'" in bad.content
    raised = call_tool(fns, "explode", {"x": 5}, 1.0)
    assert (raised.error, raised.content) == ("raised", "{'error': 'no 5'}")  # TRL's text for a failed call
    slow = call_tool(fns, "hang", {"x": 1}, 0.2)
    assert slow.error == "timeout" and "timed out after 0.2 s" in slow.content

    def quit_(x: int) -> int:
        raise SystemExit(3)

    with pytest.raises(GRPOError, match="tool 'quit_' tried to end the process"):
        call_tool({"quit_": quit_}, "quit_", {"x": 1}, 1.0)


def test_options_leave_old_config_hashes_alone(assets):
    from pipeline import config as config_mod

    cfg = config_mod.resolve(base_config(assets))
    assert '"tools"' not in config_mod.canonical(cfg) and '"max_turns"' not in config_mod.canonical(cfg)
    with_tools = config_mod.resolve(base_config(assets, rollout={"tools": ["python"]}))
    assert config_mod.config_hash(with_tools) != config_mod.config_hash(cfg)


# ------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("rollout, message", [
    ({"tools": ["{f}:no_hints"]}, "rollout.tools[0] '{f}:no_hints': .*type hints"),
    ({"tools": ["{f}:no_doc"]}, "rollout.tools[0] '{f}:no_doc': .*no docstring"),
    ({"tools": ["{d}/missing.py:f"]}, "rollout.tools[0] '{d}/missing.py:f': no file"),
    ({"tools": ["{f}:nothing"]}, "rollout.tools[0] '{f}:nothing': no function 'nothing'"),
    ({"environment": "{f}:NoReset"}, "rollout.environment '{f}:NoReset': the class has no reset method"),
])
def test_bad_tools_fail_at_init(assets, tools_file, tmp_path, rollout, message):
    rollout = {k: ([x.format(f=tools_file, d=tools_file.parent) for x in v] if isinstance(v, list) else v.format(f=tools_file))
               for k, v in rollout.items()}
    cfg = write_config(tmp_path / "cfg.yaml", base_config(assets, rollout=rollout))
    proc = grpo("init", str(tmp_path / "run"), "--config", str(cfg), check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr
    import re

    assert re.search(re.escape(message.format(f=tools_file, d=tools_file.parent)).replace(r"\.\*", ".*"), errors[0]), errors[0]
    assert not (tmp_path / "run").exists()


def test_template_that_cannot_express_tools(assets, tools_file, tmp_path):
    from pipeline import config as config_mod, preflight
    from pipeline.errors import GRPOError

    model = tmp_path / "model"
    shutil.copytree(assets["model"], model)
    # a template that knows only user and assistant turns: no tool role, no system message for the fallback
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('roles!') }}{% endif %}"
        "{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    cfg = config_mod.resolve(base_config(assets, model=str(model), rollout={"tools": [f"{tools_file}:multiply"]}))
    with pytest.raises(GRPOError, match="can express neither tool calls nor the Hermes fallback"):
        preflight.check(cfg)
    with pytest.raises(GRPOError, match="need chat prompts"):
        config_mod.resolve(base_config(assets, data={"chat_template": False}, rollout={"tools": ["python"]}))


def test_fallback_note_and_glue_on_the_test_template(assets):
    from transformers import AutoTokenizer

    from pipeline.agents.format import choose

    tok = AutoTokenizer.from_pretrained(assets["model"])
    fmt, note = choose(tok, "auto", "tiny")
    assert fmt.kind == "hermes" and "has no tool support; using the Hermes fallback" in note
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "raw": call_text("m", {})},
            {"role": "tool", "name": "m", "content": "7"}]
    glue = fmt.glue_text(msgs, 1, [], "<|im_end|>", True)
    assert glue == "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
