"""Multi-turn episodes with tools and environments (pipeline/agents): call parsing, tool outcomes,
the token record (sampled tokens kept, glue and results under mask 0), endings, environments
as TRL's environment_factory, bad input at `grpo init`, and on SmolLM2 (whose template has no
tool support: the Hermes fallback) real tool calls through `grpo iterate` with a LoRA adapter.
SmolLM2 with Qwen3's template, across shards, replay and audit: tests/test_trl_examples.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import base_config, grpo, write_config

TOOLS = '''
import os, signal, time


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    kill = os.environ.get("KILL_ONCE")  # a worker dying mid-part, once
    if kill and not os.path.exists(kill):
        open(kill, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
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
    # a whole call never closed (the model stopped before </tool_call>): malformed, as TRL's Qwen response
    # template reads no call there and the turn is plain text (was: run as a call)
    content, calls = parse_hermes('Sure.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}')
    assert content == "Sure." and [(c.name, c.arguments) for c in calls] == [(None, '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}')]
    assert parse_hermes("no call here") == ("no call here", [])


def test_hermes_call_arguments_are_read_as_trls_qwen_parser_reads_them():
    """TRL 1.16 reads a Qwen/Hermes call with its qwen3 response template: the arguments are the
    "arguments" key, none when it is missing or null (its _validate_tool_calls), so a call written with
    Llama's "parameters" key is a call with no arguments (answered with Python's missing-argument
    text). Was: "parameters" read as the arguments, and the tool ran."""
    from transformers.utils.chat_parsing.response_parser import parse_response
    from trl.chat_template_utils import _validate_tool_calls, qwen3_template

    from pipeline.agents.format import parse_hermes

    for body in ({"name": "multiply", "parameters": {"a": 2, "b": 3}}, {"name": "multiply", "arguments": {"a": 2}},
                 {"name": "multiply"}, {"name": "multiply", "arguments": None}):
        text = "<tool_call>\n" + json.dumps(body) + "\n</tool_call>"
        trl = parse_response(text + "<|im_end|>", qwen3_template, prefix="<|im_start|>assistant\n")
        _validate_tool_calls(trl["tool_calls"])
        assert [(c.name, c.arguments) for c in parse_hermes(text)[1]] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in trl["tool_calls"]], body


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
    assert (bad.error, bad.content) == ("bad_arguments", str({"error": "multiply() missing 1 required positional argument: 'b'"}))
    raised = call_tool(fns, "explode", {"x": 5}, 1.0)
    assert (raised.error, raised.content) == ("raised", "{'error': 'no 5'}")  # TRL's text for a failed call
    slow = call_tool(fns, "hang", {"x": 1}, 0.2)
    assert slow.error == "timeout" and "timed out after 0.2 s" in slow.content

    async def asleep(x: int) -> int:
        await __import__("asyncio").sleep(3)
        return x

    def own_timeout(x: int) -> int:
        raise TimeoutError("upstream took too long")

    assert call_tool({"asleep": asleep}, "asleep", {"x": 1}, 0.2).error == "timeout"
    assert call_tool({"own_timeout": own_timeout}, "own_timeout", {"x": 1}, 1.0).error == "raised"

    def quit_(x: int) -> int:
        raise SystemExit(3)

    with pytest.raises(GRPOError, match="tool 'quit_' tried to end the process"):
        call_tool({"quit_": quit_}, "quit_", {"x": 1}, 1.0)


def test_builtin_python_tool_runs_in_the_sandbox():
    from pipeline.agents.tools import call_tool, load_tools

    fns = {f.__name__: f for f in load_tools(["python"], timeout_s=10.0)}
    out = call_tool(fns, "python", {"code": "print(123456789 * 987654321)"}, 20.0)
    assert out.error is None and out.content.strip() == str(123456789 * 987654321)
    err = call_tool(fns, "python", {"code": "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)"}, 20.0)
    assert err.error is None and "Error" in err.content  # no network in the sandbox; the failure is the answer


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

    from pipeline.agents.probe import choose

    tok = AutoTokenizer.from_pretrained(assets["model"])
    fmt, note = choose(tok, "auto", "tiny")
    assert fmt.kind == "hermes" and "has no tool support; using the Hermes fallback" in note
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "raw": call_text("m", {})},
            {"role": "tool", "name": "m", "content": "7"}]
    glue = fmt.glue_text(msgs, 1, [], "<|im_end|>", True)
    assert glue == "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


# ------------------------------------------------------------------- the loop on the real engine
def tool_rows(path: Path, n: int = 8) -> str:
    """Chat prompts whose conversation already holds a worked Hermes tool call."""
    rows = []
    for i in range(n):
        a, b = 11 + 7 * i, 23 + 3 * i
        msgs = [{"role": "user", "content": "What is 12 * 13?"}, {"role": "assistant", "content": call_text("multiply", {"a": 12, "b": 13})},
                {"role": "user", "content": "<tool_response>\n156\n</tool_response>"}, {"role": "assistant", "content": "156"},
                {"role": "user", "content": "What is 41 * 27?"}, {"role": "assistant", "content": call_text("multiply", {"a": 41, "b": 27})},
                {"role": "user", "content": "<tool_response>\n1107\n</tool_response>"}, {"role": "assistant", "content": "1107"},
                {"role": "user", "content": f"What is {a} * {b}?"}]
        rows.append({"prompt": msgs, "answer": f"{a} * {b} = {a * b}\n#### {a * b}"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def tiny2k(assets, tmp_path_factory) -> str:
    """The session's tiny model with a 2048-token context (its rotary positions extend to any
    length): the Hermes tool block alone is ~700 of its tokens, more than its own 512."""
    model = tmp_path_factory.mktemp("tiny2k") / "model"
    shutil.copytree(assets["model"], model)
    conf = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**conf, "max_position_embeddings": 2048}))
    return str(model)


def forced(tok, text: str):
    """A model turn that wrote `text` and ended with its end-of-turn token (logprob -0.5 each)."""
    from pipeline.models.engines import Sample

    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return Sample(text, ids, [-0.5] * len(ids), "stop")


def agent_plan(make_run, tiny2k, tmp_path, tools, name="agents", **rollout):
    from pipeline.rollout import RolloutInputs
    from pipeline.run.run import Run

    ro = {"tools": tools, "max_new_tokens": 12, "max_episode_tokens": 400, "tool_timeout_s": 0.3, **rollout}
    path = make_run(name, model=tiny2k, data={"train": tool_rows(tmp_path / "tools.jsonl"), "system_prompt": None},
                    rollout=ro, rewards=[{"fn": "correct"}])
    run = Run(path)
    return run, RolloutInputs(run, 0)


@pytest.mark.slow
def test_episode_tokens_masks_and_tool_answers(make_run, tiny2k, tools_file, tmp_path, monkeypatch):
    from pipeline.agents.episode import trl_completion
    from pipeline.rollout import policy_engine
    from schemas.artifacts import ROLLOUT

    monkeypatch.setenv("CALC_LOG", str(tmp_path / "calls.log"))
    run, plan = agent_plan(make_run, tiny2k, tmp_path, [f"{tools_file}:{n}" for n in ("multiply", "explode", "hang")])
    runner, tok, p = plan.episodes, plan.tokenizer, plan.prompts[0]
    first_turns = {  # what each episode's first turn wrote -> the error its tool answer records
        call_text("multiply", {"a": 11, "b": 23}): None,
        call_text("divide", {"a": 1}): "unknown_tool",
        call_text("multiply", {"a": 1, "c": 2}): "bad_arguments",
        call_text("explode", {"x": 4}): "raised",
        call_text("hang", {"x": 1}): "timeout",
    }
    episodes = []
    for j, text in enumerate(first_turns):
        e = runner.start(p, 0, j, plan.group_seed(p.prompt_id), "test")
        assert runner._after_turn(e, forced(tok, text), 12)  # the calls run, the glue is appended
        episodes.append(e)
    engine = policy_engine(run, 0)
    try:
        runner.run(engine, episodes)  # the real engine takes every next turn
    finally:
        engine.close()
    assert (tmp_path / "calls.log").read_text() == "11*23\n"  # the one good multiply call ran, once
    for e, (text, error) in zip(episodes, first_turns.items()):
        row = runner.row(e, plan.policy_hash)
        rec = json.loads(row["episode"])
        tool = rec["messages"][1]
        assert tool["role"] == "tool" and tool["error"] == error
        assert tool["content"] == ("253" if error is None else tool["content"]) and (error is None or "error" in tool["content"])
        ids, mask, lps = row["completion_ids"], row["completion_mask"], row["sampler_logprobs"]
        n0 = rec["messages"][0]["tokens"]
        glue = e.texts[1]
        glue_ids = tok(glue, add_special_tokens=False)["input_ids"]
        # turn 1 exactly as "sampled", then the glue tokenised on its own, then turn 2 as sampled
        assert ids[:n0] == forced(tok, text).token_ids
        assert ids[n0:n0 + len(glue_ids)] == glue_ids and tool["content"] in glue
        assert mask == [1] * n0 + [0] * len(glue_ids) + [1] * (len(ids) - n0 - len(glue_ids))
        assert all(lp == 0.0 for lp, m in zip(lps, mask) if m == 0) and all(lp < 0 for lp, m in zip(lps, mask) if m == 1)
        assert rec["model_tokens"] == sum(mask) and rec["context_tokens"] == len(glue_ids)
        assert rec["turns"] >= 2 and rec["ending"] in ("answered", "max_turns", "length")
        assert row["completion"] == text + glue + "".join(e.texts[2:])
        # the whole sequence is what the template renders for the conversation: no re-tokenising drift
        assert tok.decode(row["prompt_ids"] + ids[:n0 + len(glue_ids)]).endswith(
            text + "<|im_end|>\n<|im_start|>user\n<tool_response>\n" + tool["content"] + "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
        trl = trl_completion(rec)
        assert trl[1] == {"role": "tool", "name": tool["name"] or "unknown", "content": tool["content"]}
        assert set(trl[0]) <= {"role", "content", "tool_calls"}
    ROLLOUT.conform(__import__("pyarrow").Table.from_pylist([runner.row(e, plan.policy_hash) for e in episodes]))


@pytest.mark.slow
def test_endings_max_turns_and_budget(make_run, tiny2k, tools_file, tmp_path, monkeypatch):
    monkeypatch.setenv("CALC_LOG", str(tmp_path / "calls.log"))
    run, plan = agent_plan(make_run, tiny2k, tmp_path, [f"{tools_file}:multiply"], max_turns=1)
    runner, tok, p = plan.episodes, plan.tokenizer, plan.prompts[0]
    e = runner.start(p, 0, 0, 1, "test")
    assert not runner._after_turn(e, forced(tok, call_text("multiply", {"a": 2, "b": 3})), 12)
    assert e.ending == "max_turns" and len(e.messages) == 1 and not (tmp_path / "calls.log").exists()  # the call is not run

    run2, plan2 = agent_plan(make_run, tiny2k, tmp_path, [f"{tools_file}:multiply"], name="budget", max_episode_tokens=80)
    text = call_text("multiply", {"a": 2, "b": 3})  # ~70 tokens of the tiny tokenizer: the glue cannot fit in 80
    e = plan2.episodes.start(plan2.prompts[0], 0, 0, 1, "test")
    assert not plan2.episodes._after_turn(e, forced(plan2.tokenizer, text), 12)
    assert e.ending == "max_episode_tokens" and e.messages[1]["dropped"] is True
    assert (tmp_path / "calls.log").read_text() == "2*3\n"  # it ran; its result is left out of the tokens
    row = plan2.episodes.row(e, "h")
    assert row["completion_mask"] == [1] * len(row["completion_ids"])
    from pipeline.agents.episode import trl_completion

    assert [m["role"] for m in trl_completion(json.loads(row["episode"]))] == ["assistant"]

    # the edge, as TRL's _tool_call_loop draws it: results are dropped when the completion with them would
    # pass max_completion_length (len > budget), kept when it lands on it exactly (was: dropped there too,
    # for want of room for one more token); the episode then ends, as TRL's next turn is cut to nothing
    roomy = plan2.episodes.start(plan2.prompts[0], 0, 0, 1, "test")
    plan2.episodes.budget = 10**4  # measure what the turn and its results take
    assert plan2.episodes._after_turn(roomy, forced(plan2.tokenizer, text), 12)
    n = len(roomy.ids)
    for budget, kept in ((n, True), (n - 1, False)):
        _, plan3 = agent_plan(make_run, tiny2k, tmp_path, [f"{tools_file}:multiply"], name=f"edge{budget}", max_episode_tokens=budget)
        e = plan3.episodes.start(plan3.prompts[0], 0, 0, 1, "test")
        assert not plan3.episodes._after_turn(e, forced(plan3.tokenizer, text), 12)
        assert e.ending == "max_episode_tokens" and e.messages[1].get("dropped", False) is not kept
        assert e.ids == (roomy.ids if kept else roomy.ids[:len(e.ids)]) and len(e.ids) <= budget
        roles = [m["role"] for m in trl_completion(json.loads(plan3.episodes.row(e, "h")["episode"]))]
        assert roles == (["assistant", "tool"] if kept else ["assistant"])


@pytest.mark.slow
def test_environment_as_trl_factory(make_run, tiny2k, tools_file, tmp_path):
    """reset(**row) observation appended to the last user message, methods as tools, and reward
    functions get `environments`: instances rebuilt from the state they ended with."""
    from pipeline.rollout import policy_engine
    from pipeline.score import trl_inputs
    import pyarrow as pa

    run, plan = agent_plan(make_run, tiny2k, tmp_path, [], environment=f"{tools_file}:Counter", max_turns=2)
    runner, tok, p = plan.episodes, plan.tokenizer, plan.prompts[0]
    e = runner.start(p, 0, 0, plan.group_seed(p.prompt_id), "test")
    assert e.observation == " (env ready)" and "(env ready)<|im_end|>\n<|im_start|>assistant\n" in e.prompt_text
    assert "guess" in e.tools and '"name": "guess"' in e.prompt_text  # the method is offered as a tool
    target = e.env.target
    assert runner._after_turn(e, forced(tok, call_text("guess", {"n": target})), 12)
    engine = policy_engine(run, 0)
    try:
        runner.run(engine, [e])
    finally:
        engine.close()
    rec_row = runner.row(e, plan.policy_hash)
    assert json.loads(rec_row["episode"])["messages"][1]["content"] == "yes"
    prompts, completions, _, columns = trl_inputs(pa.Table.from_pylist([rec_row]), None, run.cfg.rollout.environment)
    env = columns["environments"][0]
    assert type(env).__name__ == "Counter" and env.guesses == [target] and env.target == target
    assert prompts[0][-1]["content"].endswith("(env ready)")
    assert completions[0][1] == {"role": "tool", "name": "guess", "content": "yes"}


# ------------------------------------------------------------------------ SmolLM2, whole stages
REWARD = '''
def used_tool(completions, answer, **kwargs):
    """1 when a tool message of the episode carries the product (completions: TRL's messages)."""
    return [float(any(m["role"] == "tool" and m["content"] == a.split("#### ")[-1] for m in c)) for c, a in zip(completions, answer)]
'''


def rollout_manifest(run: Path) -> dict:
    return json.loads((run / "iter-0000/rollout/MANIFEST.json").read_text())


QWEN_LIKE = (  # the shape of Qwen 2.5's tool template: tools in the system turn, calls as <tool_call> JSON
    "{%- if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}Be helpful."
    "{% endif %}\n\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{%- elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'assistant' and not m.tool_calls) %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}{% for tc in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n'
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- endif %}{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


LLAMA_LIKE = (  # the shape of Llama 3.2's tool template: calls as one bare JSON object with "parameters", results as ipython turns
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nYou may call these functions:{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}{{ eos_token }}{% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    '{% for tc in m.tool_calls %}{"name": "{{ tc.function.name }}", "parameters": {{ tc.function.arguments | tojson }}}{% endfor %}{{ eos_token }}'
    "{% elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}{{ eos_token }}"
    "{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def test_parse_llama_json_calls():
    from pipeline.agents.format import parse_json_call

    assert [(c.name, c.arguments) for c in parse_json_call('{"name": "multiply", "parameters": {"a": 6, "b": 7}}')[1]] == [("multiply", {"a": 6, "b": 7})]
    content, calls = parse_json_call('<|python_tag|>{"name": "m", "arguments": "{\\"a\\": 1}"}')
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("m", {"a": 1})]
    assert [c.name for c in parse_json_call('{"name": "multiply", "parameters": {"a": 6')[1]] == [None]  # cut off: malformed
    assert parse_json_call("6 * 7 = 42") == ("6 * 7 = 42", [])
    assert parse_json_call('{"answer": 42}') == ('{"answer": 42}', [])  # JSON, but not a call


def test_a_llama_style_template_is_used_with_its_bare_json_calls(assets, tools_file):
    """A template that renders calls as Llama 3.x does (bare JSON) is used as it is, and calls are
    read in that format, instead of falling back to Hermes."""
    from transformers import AutoTokenizer

    from pipeline.agents.probe import choose
    from pipeline.agents.tools import load_tools, tool_schema

    tok = AutoTokenizer.from_pretrained(assets["model"])
    tok.chat_template = LLAMA_LIKE
    fmt, note = choose(tok, "auto", "llama-like")
    assert (fmt.kind, fmt.parser, note) == ("template", "json", None)
    schema = tool_schema(load_tools([f"{tools_file}:multiply"])[0], "t")
    prompt = fmt.render([{"role": "user", "content": "6 * 7?"}], [schema], True)
    assert '"name": "multiply"' in prompt and prompt.endswith("user<|end_header_id|>\n\n6 * 7?<|im_end|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert [(c.name, c.arguments) for c in fmt.parse('{"name": "multiply", "parameters": {"a": 6, "b": 7}}', "")[1]] == [("multiply", {"a": 6, "b": 7})]
    msgs = [{"role": "user", "content": "6 * 7?"},
            {"role": "assistant", "content": "", "tool_calls": [{"name": "multiply", "arguments": {"a": 6, "b": 7}}]},
            {"role": "tool", "name": "multiply", "content": "42"}]
    assert fmt.glue_text(msgs, 1, [schema], "<|im_end|>", True) == \
        "<|start_header_id|>ipython<|end_header_id|>\n\n42<|im_end|><|start_header_id|>assistant<|end_header_id|>\n\n"


def test_a_template_with_tool_support_is_used_as_is(assets, tools_file):
    from transformers import AutoTokenizer

    from pipeline.agents.probe import choose
    from pipeline.agents.tools import load_tools, tool_schema

    tok = AutoTokenizer.from_pretrained(assets["model"])
    # as one line, with a newline right after a block tag spelled out (apply_chat_template trims those)
    tok.chat_template = QWEN_LIKE.replace("{%-", "{%").replace("%}\n", "%}{{ '\\n' }}")
    fmt, note = choose(tok, "auto", "qwen-like")
    assert (fmt.kind, fmt.parser, note) == ("template", "hermes", None)
    schema = tool_schema(load_tools([f"{tools_file}:multiply"])[0], "t")
    prompt = fmt.render([{"role": "user", "content": "6 * 7?"}], [schema], True)
    assert '"name": "multiply"' in prompt and prompt.endswith("<|im_start|>user\n6 * 7?<|im_end|>\n<|im_start|>assistant\n")
    msgs = [{"role": "user", "content": "6 * 7?"},
            {"role": "assistant", "content": "", "tool_calls": [{"name": "multiply", "arguments": {"a": 6, "b": 7}}]},
            {"role": "tool", "name": "multiply", "content": "42"}]
    assert fmt.glue_text(msgs, 1, [schema], "<|im_end|>", True) == \
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert choose(tok, "hermes", "qwen-like")[0].kind == "hermes"  # the fallback on request


def test_episode_metrics_and_conversation_view():
    from pipeline.report.episodes import conversation, episode_metrics

    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 2, "b": 3}}}
    one = {"messages": [{"role": "assistant", "content": "", "text": call_text("multiply", {"a": 2, "b": 3}), "tokens": 20,
                         "finish_reason": "stop", "tool_calls": [call]},
                        {"role": "tool", "name": "multiply", "content": "6", "error": None},
                        {"role": "assistant", "content": "6", "text": "6", "tokens": 2, "finish_reason": "stop"}],
           "turns": 2, "ending": "answered", "model_tokens": 22, "context_tokens": 18, "observation": None}
    two = {"messages": [{"role": "assistant", "content": "", "text": "<tool_call>{x</tool_call>", "tokens": 9, "finish_reason": "stop",
                         "tool_calls": [{"type": "function", "function": {"name": None, "arguments": "{x"}}]},
                        {"role": "tool", "name": None, "content": "{'error': 'malformed tool call: {x'}", "error": "malformed"},
                        {"role": "assistant", "content": "", "text": call_text("multiply", {}), "tokens": 11, "finish_reason": "stop",
                         "tool_calls": [call]}],
           "turns": 2, "ending": "max_turns", "model_tokens": 20, "context_tokens": 20, "observation": None}
    m = episode_metrics([one, two])
    # 2 episodes: 2 turns each; 2 tool answers (1 multiply, 1 malformed), 1 failed; tokens 42 sampled of 80
    assert m["episodes/turns_mean"] == 2.0 and m["episodes/ending/answered"] == 0.5 and m["episodes/ending/max_turns"] == 0.5
    assert m["tools/call_frequency"] == 1.0 and m["tools/failure_frequency"] == 0.5
    assert m["tools/calls/multiply"] == 0.5 and m["tools/calls/malformed"] == 0.5 and m["tools/errors/malformed"] == 1.0
    assert m["tokens/model_share"] == pytest.approx(42 / 80, abs=1e-12)
    answered_alone = {**one, "messages": one["messages"][2:], "turns": 1}
    assert episode_metrics([one, two])["tools/used"] == 1.0 and episode_metrics([one, answered_alone])["tools/used"] == 0.5
    assert episode_metrics([]) == {}
    view = conversation(one)
    assert view.splitlines() == [
        f"[assistant, 20 tokens] {call_text('multiply', {'a': 2, 'b': 3})}".splitlines()[0], *view.splitlines()[1:3],
        '  -> call multiply({"a": 2, "b": 3})', "[tool multiply] 6", "[assistant, 2 tokens] 6",
        "[end: answered after 2 turns; 22 sampled + 18 context tokens]"]


@pytest.mark.slow
def test_eval_runs_episodes_with_the_tools(make_run, tiny2k, tools_file, tmp_path):
    from pipeline.eval.run import run_eval
    from pipeline.run.run import Run

    rows = tool_rows(tmp_path / "tools.jsonl")
    run = Run(make_run("eval", model=tiny2k, data={"train": rows, "eval": rows, "system_prompt": None},
                       rollout={"tools": [f"{tools_file}:multiply"], "max_new_tokens": 12, "max_episode_tokens": 200},
                       rewards=[{"fn": "correct"}], eval={"every": 1, "max_prompts": 3}))
    run_eval(run, 0)
    table = pq.read_table(next((Path(run.uri) / "iter-0000/eval").glob("part-*.parquet"))).to_pylist()
    assert len(table) == 3
    for r in table:
        rec = json.loads(r["episode"])
        assert rec["format"] == "hermes" and rec["tools"] == ["multiply"] and rec["turns"] >= 1
        assert '"name": "multiply"' in r["prompt"]  # the eval prompt offers the tool, as the rollout's does


def model_tokens(run: Path, k: int) -> int:
    """The tokens the model sampled in iteration k's rollout: the stored completion_mask's ones."""
    return sum(sum(r["completion_mask"]) for p in sorted((run / f"iter-{k:04d}/rollout").glob("part-*.parquet"))
               for r in pq.read_table(p, columns=["completion_mask"]).to_pylist())


@pytest.mark.slow
def test_smollm2_gguf_lora_tool_episodes_through_iterate(assets, smollm2, tools_file, tmp_path):
    """A TRL-style tool on SmolLM2 given as its GGUF file, trained as a LoRA adapter: `grpo
    iterate` samples tool episodes, scores them on the conversation, and updates on the model's
    own tokens only (each step's token count is the rollout's mask sum, never the tool results);
    the policies are adapters and the run audits clean."""
    (tmp_path / "rw.py").write_text(REWARD)
    cfg = base_config(assets, model=smollm2["gguf"], data={"train": tool_rows(tmp_path / "tools.jsonl", 4), "system_prompt": None},
                      rollout={"num_generations": 8, "prompts_per_iter": 2, "groups_per_part": 1, "max_new_tokens": 40,
                               "temperature": 0.7, "tools": [f"{tools_file}:multiply"], "max_turns": 2, "max_episode_tokens": 160},
                      rewards=[{"fn": f"{tmp_path / 'rw.py'}:used_tool"}],
                      train={"mini_batch_size": 16, "lr": 1e-4, "lora": {"r": 8, "alpha": 16}})
    run = tmp_path / "run"
    init = grpo("init", str(run), "--config", str(write_config(tmp_path / "cfg.yaml", cfg)))
    assert "has no tool support; using the Hermes fallback" in init.stdout
    grpo("iterate", str(run), "--iters", "2", env={"CALC_LOG": str(tmp_path / "calls.log")})
    assert (tmp_path / "calls.log").read_text().strip(), "no sample called the tool"
    assert rollout_manifest(run)["inputs"]["chat_template"]["tool_format"] == "hermes"
    for k in (0, 1):
        episodes = [json.loads(e) for p in sorted((run / f"iter-{k:04d}/rollout").glob("part-*.parquet"))
                    for e in pq.read_table(p, columns=["episode"]).column("episode").to_pylist()]
        assert len(episodes) == 16 and all(e["ending"] for e in episodes)
        metrics = pq.read_table(run / f"iter-{k:04d}/update/metrics.parquet").to_pylist()
        assert len(metrics) == 1 and metrics[0]["tokens"] == model_tokens(run, k)
        assert (run / f"policy/iter-{k + 1:04d}/adapter_config.json").exists()
        assert not list((run / f"policy/iter-{k + 1:04d}").glob("model*.safetensors"))
    assert any(json.loads(e)["turns"] > 1 for p in (run / "iter-0000/rollout").glob("part-*.parquet")
               for e in pq.read_table(p, columns=["episode"]).column("episode").to_pylist())
    assert ": ok, 2 iteration(s)" in grpo("audit", str(run)).stdout  # every episode row's ids re-derived from its record
    # a row whose glue ids were changed (one turned into <|im_end|>) with its part's hash recomputed: audit names the row
    import hashlib

    import pyarrow as pa
    from transformers import AutoTokenizer

    part, i = next((p, i) for p in sorted((run / "iter-0000/rollout").glob("part-*.parquet"))
                   for i, r in enumerate(pq.read_table(p, columns=["completion_mask"]).to_pylist()) if 0 in r["completion_mask"])
    table = pq.read_table(part)
    rows = table.to_pylist()
    at = rows[i]["completion_mask"].index(0) + 2
    rows[i]["completion_ids"][at] = AutoTokenizer.from_pretrained(smollm2["dir"]).convert_tokens_to_ids("<|im_end|>")
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), part)
    manifest = json.loads((part.parent / "MANIFEST.json").read_text())
    manifest["outputs"][part.name].update(sha256=hashlib.sha256(part.read_bytes()).hexdigest(), bytes=part.stat().st_size)
    (part.parent / "MANIFEST.json").write_text(json.dumps(manifest))
    out = grpo("audit", str(run), check=False).stdout
    assert f"iter-0000/rollout/{part.name}: row {i}: completion_ids at token {at - 2} are not the tokens of the glue" in out, out
