"""The vendors' own chat templates, as TRL 1.16 ships them (`trl/chat_templates/*.jinja`), with
tools: every one TRL can train tools with passes `grpo init`'s checks; Qwen3's, which rewrites
an assistant turn once a tool's result follows it, runs with the same training template TRL swaps
in; a template that drops past thinking is refused at init, not at its first thinking turn; and
gpt-oss's and LFM2's calls are read in their own formats.

Which templates TRL can train tools with is decided by TRL's own functions (its GRPOTrainer's
checks): the template renders a whole tool exchange (supports_tool_calling), TRL has a response
parser for it (add_response_schema), and it is prefix-preserving or TRL has a training template.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from conftest import base_config

# the markers templates write as special tokens: <|im_end|>, <start_of_turn>, [INST], <｜Assistant｜>, ...
SPECIAL = re.compile(r"<\|[^<>|\s'\"]+\|>|<[^<>|\s'\"]+\|>|<\|[^<>|\s'\"]+>|<｜[^｜]+｜>|\[/?[A-Z_]+\]|<(?:start|end)_of_turn>|</?s>")

TOOLS = '''
def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b
'''

def trl_templates() -> dict[str, str]:
    """{name: text} of TRL's vendor templates (not its *_training variants)."""
    import trl.chat_template_utils as u

    folder = Path(u.__file__).parent / "chat_templates"
    return {p.stem: p.read_text() for p in sorted(folder.glob("*.jinja")) if not p.stem.endswith("_training")}


def with_template(tok_dir: Path, text: str):
    """The tiny model's tokenizer with `text` as its chat template and the template's markers added as special tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    markers = sorted(set(SPECIAL.findall(text)) - set(tok.get_vocab()))
    if markers:
        tok.add_special_tokens({"additional_special_tokens": markers}, replace_extra_special_tokens=False)
    tok.chat_template = text
    return tok


def trl_trains_tools_with(tok) -> bool:
    """TRL 1.16's GRPOTrainer accepts this tokenizer with tools (its own checks, in its order)."""
    import trl.chat_template_utils as u

    if not u.supports_tool_calling(tok):
        return False
    try:
        u.add_response_schema(tok)
        if not u.is_chat_template_prefix_preserving(tok):
            return u.get_training_chat_template(tok) is not None
        return True
    except ValueError:
        return False
    finally:
        tok.response_template = None


@pytest.fixture(scope="module")
def tools_py(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("vendor-tools") / "vendor_tools.py"
    path.write_text(TOOLS)
    return path


def test_init_accepts_every_vendor_template_trl_trains_tools_with(assets, tools_py, tmp_path):
    """Each of TRL's vendor templates that TRL can train tools with, on the tiny model's tokenizer,
    passes `grpo init`'s checks with a tool (the probe: a call and a call after thinking, rendered,
    parsed back and glued); Qwen3 with its training template, the others as shipped, each in its own
    call format but Gemma 4's (the Hermes fallback, with a note)."""
    from pipeline import config as config_mod, preflight
    from pipeline.agents.probe import choose

    model = tmp_path / "model"
    shutil.copytree(assets["model"], model)
    trained, formats = [], {}
    for name, text in trl_templates().items():
        tok = with_template(Path(assets["model"]), text)
        if not trl_trains_tools_with(tok):
            continue
        trained.append(name)
        tok.save_pretrained(model)
        cfg = config_mod.resolve(base_config(assets, model=str(model), rollout={"tools": [f"{tools_py}:multiply"]}))
        notes = preflight.check(cfg)  # what `grpo init` runs before it writes anything; raises the first failure
        fmt, note = choose(tok, "auto", str(model))
        assert notes == ([note] if note else []), name
        formats[name] = (fmt.kind, fmt.parser, fmt.template.name)
    assert len(trained) >= 22 and {"qwen3", "gptoss", "qwen3_5_think", "glm4moe", "llama3_1"} <= set(trained), trained
    assert formats["qwen3"] == ("template", "hermes", "qwen3_training")
    assert formats["gptoss"] == ("template", "harmony", "model")
    assert formats["lfm2_2_5"] == ("template", "pythonic", "model")
    assert all(t == "model" for n, (_, _, t) in formats.items() if n != "qwen3")
    assert {n for n, (kind, _, _) in formats.items() if kind == "hermes"} == {n for n in trained if n.startswith("gemma4")}


def conversations():
    """Tool episodes as a template gets them: calls with and without thinking, results, answers."""
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}}}
    user = {"role": "user", "content": "What is 6 * 7?"}
    tool = {"role": "tool", "name": "multiply", "content": "42"}
    for said in ("", "<think>\n\n</think>\n\n", "<think>\nI should multiply.\n</think>\n\n", "Let me compute."):
        turn = {"role": "assistant", "content": said, "tool_calls": [call]}
        yield [user, turn]
        yield [user, turn, tool]
        yield [user, turn, tool, {"role": "assistant", "content": said + "It is 42."}]
        yield [{"role": "system", "content": "Be brief."}, user, turn, tool, turn, tool]


def test_qwen3_runs_with_the_training_template_trl_swaps_in(assets):
    """Qwen3's template drops an empty think block from a tool-calling turn once the tool's result
    follows it: as shipped, the probe refuses it in one line that says so; the training template
    made from its text renders every tool conversation exactly as TRL's qwen3_training.jinja."""
    import trl.chat_template_utils as u

    from pipeline.agents.format import ToolFormat
    from pipeline.agents.probe import checked, choose
    from pipeline.agents.templates import ChatTemplate, template_sha256
    from pipeline.errors import GRPOError

    original = trl_templates()["qwen3"]
    tok = with_template(Path(assets["model"]), original)
    fmt, note = choose(tok, "auto", "qwen3-model")
    assert (fmt.template.name, note) == ("qwen3_training", None)
    assert fmt.template.text != original and fmt.template.sha256 == template_sha256(fmt.template.text)
    trl_training = (Path(u.__file__).parent / "chat_templates/qwen3_training.jinja").read_text()
    tools = [{"type": "function", "function": {"name": "multiply", "description": "x", "parameters": {"type": "object", "properties": {}}}}]
    for msgs in conversations():
        for gen in (False, True):
            ours = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=gen, chat_template=fmt.template.text)
            assert ours == tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=gen,
                                                   chat_template=trl_training), msgs
    as_shipped = ToolFormat(tok, "template", "hermes", fmt.eot, ChatTemplate("model", None, template_sha256(original)))
    with pytest.raises(GRPOError) as err:
        checked(as_shipped, "qwen3-model")
    line = str(err.value)
    assert "\n" not in line and line.startswith("rollout.tools: the chat template of qwen3-model renders a tool-calling turn "
                                                 "differently once the tool's result follows it, in its own tool format")
    assert "<think>" in line and "no training template is known for it" in line


def test_a_template_that_drops_past_thinking_is_refused_at_init(assets):
    """LFM2.5's template strips the thinking of assistant turns before the last user message; in
    the Hermes fallback a tool's result is a user message, so a turn's thinking disappears once
    the result follows. The old probe (no thinking) passed it and the run stopped at its first
    thinking turn; now init refuses it, naming thinking. In its own format (tool messages) it runs."""
    from pipeline.agents.probe import choose
    from pipeline.errors import GRPOError

    tok = with_template(Path(assets["model"]), trl_templates()["lfm2_2_5"])
    with pytest.raises(GRPOError) as err:
        choose(tok, "hermes", "lfm-model")
    line = str(err.value)
    assert "renders a turn with thinking differently once the tool's result follows it, in the Hermes fallback" in line
    assert "probe_thinking" in line and "\n" not in line
    assert choose(tok, "auto", "lfm-model")[0].parser == "pythonic"


def test_harmony_and_python_list_calls_parse_from_sampled_tokens(assets):
    """gpt-oss's call (after its analysis channel, ended by the <|call|> stop token) and LFM2's
    Python-list calls parse from a sampled turn's tokens to the same calls; a call cut off is malformed."""
    from pipeline.agents.probe import choose

    cases = {
        "gptoss": ('<|channel|>analysis<|message|>Multiply.<|end|><|start|>assistant to=functions.multiply<|channel|>commentary json'
                   '<|message|>{"a": 6, "b": 7}', "<|call|>", [("multiply", {"a": 6, "b": 7})]),
        "lfm2_2_5": ("<think>Multiply.</think><|tool_call_start|>[multiply(a=6, b=7), note(text='x, y', tags=['a', 'b'], "
                     'meta={"ok": true})]<|tool_call_end|>', "<|im_end|>",
                     [("multiply", {"a": 6, "b": 7}), ("note", {"text": "x, y", "tags": ["a", "b"], "meta": {"ok": True}})]),
    }
    for name, (text, stop, want) in cases.items():
        tok = with_template(Path(assets["model"]), trl_templates()[name])
        fmt, _ = choose(tok, "auto", name)
        ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids(stop)]
        content, calls = fmt.parse_turn(ids, [], {tok.convert_tokens_to_ids(stop)})
        assert [(c.name, c.arguments) for c in calls] == want, name
        cut = tok(text[: text.index("7") + 1], add_special_tokens=False)["input_ids"]
        assert [c.name for c in fmt.parse_turn(cut, [], set())[1]] == [None], name


def test_a_call_inside_qwen3_thinking_is_not_a_call_as_trls_parser_reads_it(assets):
    """TRL 1.16 parses a Qwen3 turn with its qwen3 response template: a <think> block (to </think>, or
    the end when never closed) is reasoning_content, a <tool_call> written inside it is no call, and the
    content is what is left. Was: the call inside the thinking ran, and the content kept the block.
    The Hermes fallback (no TRL parser) keeps the thinking in the content, and runs no call in it either."""
    from transformers.utils.chat_parsing.response_parser import parse_response
    from trl.chat_template_utils import qwen3_template

    from pipeline.agents.probe import choose

    fmt, _ = choose(with_template(Path(assets["model"]), trl_templates()["qwen3"]), "auto", "qwen3-model")
    call = '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>'
    prefix = "<|im_start|>user\nWhat is 6 * 7?<|im_end|>\n<|im_start|>assistant\n"
    for text in (f"<think>Maybe {call}</think>\n\n*yes*", f"<think>\nhmm\n</think>\n\n{call}",
                 f"<think>never closed {call}", f"<think>a</think>{call}<think>b {call}</think>done"):
        trl = parse_response(text + "<|im_end|>", qwen3_template, prefix=prefix)
        content, calls = fmt.parse(text, prefix)
        assert [(c.name, c.arguments) for c in calls] == [(c["function"]["name"], c["function"]["arguments"])
                                                          for c in trl.get("tool_calls", [])], text
        assert content == (trl.get("content") or ""), text
    fallback, _ = choose(with_template(Path(assets["model"]), "{% for m in messages %}{{ m['content'] }}{% endfor %}"),
                         "auto", "plain-model")
    assert fallback.kind == "hermes"
    assert fallback.parse(f"<think>Maybe {call}</think>*yes*", "") == (f"<think>Maybe {call}</think>*yes*", [])
    content, calls = fallback.parse(f"<think>ok</think>{call}", "")
    assert content == "<think>ok</think>" and [(c.name, c.arguments) for c in calls] == [("multiply", {"a": 6, "b": 7})]


def test_a_template_that_writes_todays_date_renders_the_day_init_recorded(assets, tmp_path, monkeypatch):
    """gpt-oss's and Llama 3.2's templates write today's date into every prompt (`strftime_now`):
    `grpo init` records the day it ran (data.template_date), a stage on a later day renders that
    day, and a re-init of the same config on a later day is the same run; a template that reads
    no date records none, so the config hashes of such runs stay what they were."""
    from pipeline import config as config_mod
    from pipeline.errors import GRPOError
    from pipeline.models import template_date
    from pipeline.rollout import RolloutInputs
    from pipeline.store.run import Run, init_run

    vendors = trl_templates()
    for name, reads in [("gptoss", True), ("llama3_2", True), ("qwen3", False), ("llama3_1", False)]:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "chat_template.jinja").write_text(vendors[name])
        assert template_date.reads_date(folder) is reads, name

    model = tmp_path / "dated-model"  # the tiny model's ChatML template, with Llama 3.2's date line before it
    shutil.copytree(assets["model"], model)
    chatml = (model / "chat_template.jinja").read_text()
    (model / "chat_template.jinja").write_text("{{- 'Today Date: ' + strftime_now('%d %b %Y') + '\\n' }}" + chatml)
    cfg = config_mod.resolve(base_config(assets, model=str(model)))
    run = tmp_path / "run"

    monkeypatch.setattr(template_date, "today", lambda: "2026-01-02")
    init_run(str(run), cfg)
    assert Run(str(run)).cfg.data.template_date == "2026-01-02"
    monkeypatch.setattr(template_date, "today", lambda: "2026-03-04")  # a later day: the same run, its day kept
    init_run(str(run), cfg)
    assert Run(str(run)).cfg.data.template_date == "2026-01-02"
    prompts = RolloutInputs(Run(str(run)), 0).prompts  # rendered today, by the clock: the recorded day
    assert all(p.text.startswith("Today Date: 02 Jan 2026\n") for p in prompts), prompts[0].text[:60]

    later = tmp_path / "later"  # a new run of the same config on the later day records that day
    init_run(str(later), cfg)
    assert RolloutInputs(Run(str(later)), 0).prompts[0].text.startswith("Today Date: 04 Mar 2026\n")

    plain = config_mod.resolve(base_config(assets))  # the tiny model's own template reads no date
    init_run(str(tmp_path / "plain"), plain)
    assert Run(str(tmp_path / "plain")).cfg.data.template_date is None
    assert "template_date" not in config_mod.canonical(plain)
    assert config_mod.resolve(base_config(assets, data={**base_config(assets)["data"], "template_date": "2026-11-27"})).data.template_date == "2026-11-27"
    with pytest.raises(GRPOError, match=r"data.template_date.*YYYY-MM-DD"):
        config_mod.resolve(base_config(assets, data={**base_config(assets)["data"], "template_date": "27/11/2026"}))
