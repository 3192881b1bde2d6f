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
    from pipeline.run import template_date
    from pipeline.rollout import RolloutInputs
    from pipeline.run.run import Run, init_run

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


# llama.cpp's chat template collection (tests/fixtures/llama_cpp_templates, see its README): what grpo
# does with each, with tools. (kind, parser): accepted, in the template's own call format ("template")
# or in the Hermes fallback ("hermes", with a note saying what the template writes or that it has no tool
# support). A string: refused, the line naming what the template writes (its format, or why it cannot).
LLAMA_CPP = Path(__file__).parent / "fixtures" / "llama_cpp_templates"
OWN, FALLBACK = "template", "hermes"
LLAMA_CPP_EXPECTED = {
    "Apertus-8B-Instruct": (FALLBACK, "<|tools_prefix|>"),
    "Apriel-1.6-15b-Thinker-fixed": "renders a turn with thinking differently once the tool's result follows it, in its own tool "
                                    "format (apriel: <tool_calls>[{json}]</tool_calls>) (",  # and "it drops the turn's thinking"
    "Bielik-11B-v3.0-Instruct": (OWN, "hermes"),
    "ByteDance-Seed-OSS": (FALLBACK, "<seed:tool_call>"),
    "CohereForAI-c4ai-command-r-plus-tool_use": '[ { "tool_name": "NAME", "parameters": { "KEY": "VALUE" } } ]```',
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use": '"tool_name": "NAME", "parameters": {"KEY": "VALUE"}} ]<|END_ACTION|>',
    "GLM-4.6": (OWN, "glm"),
    "GLM-4.7-Flash": (OWN, "glm"),
    "GigaChat3-10B-A1.8B": "a separate 'function call' role message after the assistant's turn ends",
    "GigaChat3.1-10B-A1.8B": (OWN, "gigachat"),
    "HuggingFaceTB-SmolLM3-3B": (FALLBACK, "has no tool support"),
    "Kimi-K2-Instruct": (FALLBACK, "fails on a tool exchange (SecurityError"),
    "Kimi-K2-Thinking": (FALLBACK, "fails on a tool exchange (SecurityError"),
    "LFM2-8B-A1B": (FALLBACK, "has no tool support"),
    "LFM2.5-8B-A1B": (OWN, "pythonic"),
    "LFM2.5-Instruct": (FALLBACK, "has no tool support"),
    "MiMo-VL": (OWN, "hermes"),
    "MiniMax-M2": (OWN, "minimax"),
    "Mistral-Small-3.2-24B-Instruct-2506": (OWN, "mistral_args"),
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": (OWN, "qwen_xml"),
    "NVIDIA-Nemotron-Nano-v2": "in its own tool format (nemotron_v2: <TOOLCALL>[{json}]</TOOLCALL>) (it writes '\\n<SPECIAL_12>'",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": (OWN, "hermes"),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": (OWN, "hermes"),
    "Qwen-QwQ-32B": (OWN, "hermes"),
    "Qwen-Qwen2.5-7B-Instruct": (OWN, "hermes"),
    "Qwen-Qwen3-0.6B": "in its own tool format (hermes: <tool_call>{json}</tool_call>)",
    "Qwen3-Coder": (OWN, "qwen_xml"),
    "Qwen3.5-4B": (OWN, "qwen_xml"),
    "Reka-Edge": (OWN, "hermes"),
    "StepFun3.5-Flash": (OWN, "qwen_xml"),
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": (FALLBACK, "has no tool support"),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": (FALLBACK, "<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME"),
    "deepseek-ai-DeepSeek-V3.1": (FALLBACK, "<｜tool▁calls▁begin｜>"),
    "deepseek-ai-DeepSeek-V3.2": (FALLBACK, "<｜DSML｜"),
    "fireworks-ai-llama-3-firefunction-v2": "its own template fails on a tool exchange (UndefinedError: 'functions' is undefined)",
    "google-gemma-2-2b-it": "its own template fails on a tool exchange (TemplateError: Conversation roles must alternate",
    "google-gemma-4-31B-it-interleaved": (FALLBACK, "<|tool_call>call:NAME"),
    "google-gemma-4-31B-it": (FALLBACK, "<|tool_call>call:NAME"),
    "ibm-granite-granite-3.3-2B-Instruct": (FALLBACK, "has no tool support"),
    "ibm-granite-granite-4.0": (OWN, "hermes"),
    "ibm-granite-granite-4.1": (OWN, "hermes"),
    "llama-cpp-deepseek-r1": (FALLBACK, "fails on a tool exchange (TypeError"),
    "llama-cpp-rwkv-world": (FALLBACK, "has no tool support"),
    "meetkai-functionary-medium-v3.1": (FALLBACK, "<function=NAME>{\"KEY\": \"VALUE\"}</function>"),
    "meetkai-functionary-medium-v3.2": (FALLBACK, "fails on a tool exchange (TypeError"),
    "meta-llama-Llama-3.1-8B-Instruct": (OWN, "json"),
    "meta-llama-Llama-3.2-3B-Instruct": (OWN, "json"),
    "meta-llama-Llama-3.3-70B-Instruct": (OWN, "json"),
    "microsoft-Phi-3.5-mini-instruct": (FALLBACK, "has no tool support"),
    "mistralai-Ministral-3-14B-Reasoning-2512": (OWN, "mistral_args"),
    "mistralai-Mistral-Nemo-Instruct-2407": (OWN, "mistral_list"),
    "moonshotai-Kimi-K2": (FALLBACK, "<|tool_call_begin|>functions.NAME:0"),
    "openai-gpt-oss-120b": (OWN, "harmony"),
    "stepfun-ai-Step-3.5-Flash": (OWN, "qwen_xml"),
    "unsloth-Apriel-1.5": "it cannot render a call without an id and writes one into history only",
    "unsloth-mistral-Devstral-Small-2507": (OWN, "mistral_args"),
    "upstage-Solar-Open-100B": (FALLBACK, "<|tool_call:begin|>"),
}
# the tags and markers the collection's templates write, as tokens: a split between turns at a token
# boundary is then a split at a tag boundary (QwQ's `<think>` is one token in its tokenizer)
TAGS = re.compile(r"</?[A-Za-z_][\w:.\-]*>|" + SPECIAL.pattern)


def llama_cpp_tokenizer(tok_dir: Path, text: str):
    """The tiny model's tokenizer with `text` as its chat template, its markers and tags as special tokens,
    and a BOS token (the tiny tokenizer has none; Llama-based templates write one)."""
    tok = with_template(tok_dir, text)
    tags = sorted(set(TAGS.findall(text)) - set(tok.get_vocab()))
    if tags:
        tok.add_special_tokens({"additional_special_tokens": tags}, replace_extra_special_tokens=False)
    if tok.bos_token is None:
        tok.add_special_tokens({"bos_token": "<s>"})
    return tok


def test_llama_cpp_collection_is_pinned_and_complete():
    """Every template of the collection has an expected outcome below, and nothing else is expected."""
    assert sorted(p.stem for p in LLAMA_CPP.glob("*.jinja")) == sorted(LLAMA_CPP_EXPECTED)


@pytest.mark.parametrize("name", sorted(LLAMA_CPP_EXPECTED))
def test_llama_cpp_template_round_trips_a_tool_episode_or_is_refused_naming_its_format(assets, name):
    """Accepted: the probe's choice is the expected one; a call as the template writes it after its own
    generation prompt (split from the prompt at a token boundary, here) parses back from its tokens to the
    same call, and the glue holds the tool's result as the template writes it. Refused: one line naming
    what the template writes."""
    from pipeline.agents.probe import choose
    from pipeline.errors import GRPOError

    tok = llama_cpp_tokenizer(Path(assets["model"]), (LLAMA_CPP / f"{name}.jinja").read_text())
    want = LLAMA_CPP_EXPECTED[name]
    if isinstance(want, str):
        with pytest.raises(GRPOError) as err:
            choose(tok, "auto", name)
        line = str(err.value)
        assert "\n" not in line and line.startswith(f"rollout.tools: the chat template of {name} ") and want in line, line
        return
    fmt, note = choose(tok, "auto", name)
    assert (fmt.kind, note is None) == (want[0], want[0] == OWN), note
    if fmt.kind == FALLBACK:
        assert want[1] in note, note
    else:
        assert fmt.parser == want[1]
    schema = {"type": "function", "function": {"name": "multiply", "description": "Multiply two integers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
    user = {"role": "user", "content": "What is 6 * 7?"}
    call = {"name": "multiply", "arguments": {"a": 6, "b": 7}}
    raw = '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>'
    said = {"role": "assistant", "content": "", "raw": raw, "tool_calls": [call]}
    prompt = tok(fmt.render([user], [schema], True), add_special_tokens=False)["input_ids"]
    if fmt.kind == OWN:
        full = tok(fmt.render([user, said], [schema], False), add_special_tokens=False)["input_ids"]
        n = next((i for i, (a, b) in enumerate(zip(prompt, full)) if a != b), min(len(prompt), len(full)))
        turn = full[n:]
    else:
        turn = tok(raw, add_special_tokens=False)["input_ids"]
    eot = tok.convert_tokens_to_ids(fmt.eot) if fmt.eot else None
    while turn and tok.decode(turn[-1:]).strip() == "":  # the newlines after the turn's end
        turn = turn[:-1]
    content, calls = fmt.parse_turn(turn, prompt, {eot} if eot is not None else set())
    assert [(c.name, {k: str(v) for k, v in c.arguments.items()}) for c in calls] == [("multiply", {"a": "6", "b": "7"})], \
        (tok.decode(turn), calls)
    episode = [user, {"role": "assistant", "content": content, "raw": tok.decode(turn),
                      "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in calls]},
               {"role": "tool", "name": "multiply", "content": "42"}]
    glue = fmt.glue_text(episode, 1, [schema], fmt.eot or tok.eos_token or "", True)
    assert "42" in glue and fmt.render(episode, [schema], True).endswith(glue), glue


def test_wrapped_json_calls_read_as_llama_cpp_reads_them(assets):
    """GigaChat 3.1's `<|function_call|>{...}` turn, read from its tokens in the format the probe chose:
    the call, the text before it as content; a call whose JSON does not read, or with no name, is malformed.
    Apriel's and Nemotron-Nano-v2's lists: every call of a closed block; a block never closed is malformed."""
    from pipeline.agents.call_formats import parse_wrapped
    from pipeline.agents.probe import choose

    tok = llama_cpp_tokenizer(Path(assets["model"]), (LLAMA_CPP / "GigaChat3.1-10B-A1.8B.jinja").read_text())
    fmt, _ = choose(tok, "auto", "gigachat")
    for text, want in [('Let me.<|function_call|>{"name": "multiply", "arguments": {"a": 6, "b": 7}}', [("multiply", {"a": 6, "b": 7})]),
                       ('<|function_call|>{"name": "multiply", "arguments": {"a": 6', [None]),
                       ('<|function_call|>{"arguments": {"a": 6}}', [None]), ("It is 42.", [])]:
        content, calls = fmt.parse_turn(tok(text, add_special_tokens=False)["input_ids"], [], set())
        assert [(c.name, c.arguments) if c.name else None for c in calls] == want, text
        assert content == text.split("<|function_call|>")[0], text
    two = '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": "1"}}]'
    for family, (opener, closer) in [("apriel", ("<tool_calls>", "</tool_calls>")), ("nemotron_v2", ("<TOOLCALL>", "</TOOLCALL>"))]:
        assert parse_wrapped(family, f"ok {opener}{two}{closer}") == ("ok", [("a", {}), ("b", {"x": "1"})])
        assert [c[0] for c in parse_wrapped(family, f"{opener}{two}")[1]] == [None]


# Qwen QwQ-32B's template as the model ships it (llama.cpp's first copy, commit f5cd27b7, before its
# enable_thinking edit): the generation prompt opens the thinking (`<|im_start|>assistant\n<think>\n`),
# so the model's turn starts inside it and closes it with `</think>`
QWQ_AS_SHIPPED = (LLAMA_CPP / "Qwen-QwQ-32B.jinja").read_text().replace(
    "    {%- if not enable_thinking -%}{{- '</think>' -}}{%- endif -%}\n", "")


def test_thinking_the_prompt_opens_is_thinking(assets):
    """Where the generation prompt opens the thinking (QwQ-32B as shipped), the turn's text up to its
    `</think>` is thinking: not content, and a call written in it is not a call (as TRL's parsers read a
    `<think>` block; llama.cpp's test-chat.cpp reads QwQ's "Let me think about this...\\n</think>\\nThe answer
    is 42." as reasoning and content). Was: the thinking and its `</think>` were the content, and a call
    in it ran. A turn that never writes `</think>` is all answer, as TRL's DeepSeek-R1 response template
    reads a turn after its `<think>\n` prompt. The Hermes fallback keeps the thinking in the content, as the model wrote it, and runs no call in it."""
    from pipeline.agents.format import parse_hermes
    from pipeline.agents.probe import choose

    assert QWQ_AS_SHIPPED.count("<think>") == 1 and "enable_thinking" not in QWQ_AS_SHIPPED
    tok = llama_cpp_tokenizer(Path(assets["model"]), QWQ_AS_SHIPPED)
    fmt, note = choose(tok, "auto", "qwq")
    assert (fmt.kind, fmt.parser, note) == ("template", "hermes", None)
    user = {"role": "user", "content": "What is 6 * 7?"}
    prompt = tok(fmt.render([user], [], True), add_special_tokens=False)["input_ids"]
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n<think>\n")
    call = '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>'
    for text, want in [("Let me think about this...\n</think>\nThe answer is 42.", ("The answer is 42.", [])),
                       (f"Multiply.\n</think>\n\n{call}", ("", [("multiply", {"a": 6, "b": 7})])),
                       (f"Maybe {call}? No.\n</think>\n\nIt is 42.", ("It is 42.", [])),
                       (f"never closed {call}", ("never closed", [("multiply", {"a": 6, "b": 7})]))]:
        content, calls = fmt.parse_turn(tok(text, add_special_tokens=False)["input_ids"], prompt, set())
        assert (content, [(c.name, c.arguments) for c in calls]) == want, text
    assert parse_hermes(f"Maybe {call}? No.\n</think>\n\nIt is 42.", opened=True) == (f"Maybe {call}? No.\n</think>\n\nIt is 42.", [])
    content, calls = parse_hermes(f"Multiply.\n</think>\n{call}", opened=True)
    assert content == "Multiply.\n</think>" and [(c.name, c.arguments) for c in calls] == [("multiply", {"a": 6, "b": 7})]


def test_lfm2_thinking_is_not_content_and_holds_no_call_as_trls_parser_reads_it(assets):
    """TRL 1.16 reads an LFM2 / LFM2.5 turn with its lfm2 response template: a `<think>` block is the
    thinking, not content, and a `<|tool_call_start|>` list written inside it is no call. Was: the block
    stayed in the content (what reward functions get) and the call inside it ran."""
    import trl.chat_template_utils as u

    from pipeline.agents.probe import choose

    for name in ("lfm2_2_5", "lfm2_v2"):
        tok = with_template(Path(assets["model"]), trl_templates()[name])
        fmt, _ = choose(tok, "auto", name)
        assert fmt.parser == "pythonic"
        prompt = tok(fmt.render([{"role": "user", "content": "What is 6 * 7?"}], [], True), add_special_tokens=False)["input_ids"]
        call = "<|tool_call_start|>[multiply(a=6, b=7)]<|tool_call_end|>"
        for text in (f"<think>Maybe {call}</think>No.", f"<think>hm</think>{call}", f"<think>never closed {call}", "<think>a</think>42"):
            ids = tok(text, add_special_tokens=False)["input_ids"]
            u.add_response_schema(tok)
            try:
                trl = u.parse_response(tok, ids + [tok.convert_tokens_to_ids("<|im_end|>")], prefix=prompt)
            finally:
                tok.response_template = None
            content, calls = fmt.parse_turn(ids, prompt, set())
            assert [(c.name, c.arguments) for c in calls] == [(c["function"]["name"], c["function"]["arguments"])
                                                              for c in trl.get("tool_calls", [])], (name, text)
            assert content == trl["content"], (name, text)


def test_ministral_thinking_is_not_content_and_holds_no_call(assets):
    """Ministral 3 Reasoning writes its thinking as `[THINK]...[/THINK]` before the answer or its
    `[TOOL_CALLS]`: as llama.cpp's tests/test-chat.cpp reads its sample turns (reasoning format auto),
    the block is thinking, not content, as grpo reads Qwen's `<think>`; a call inside it is no call.
    Was: the block stayed in the content, and a call inside it ended the episode as malformed."""
    from pipeline.agents.probe import choose

    name = "mistralai-Ministral-3-14B-Reasoning-2512"
    tok = llama_cpp_tokenizer(Path(assets["model"]), (LLAMA_CPP / f"{name}.jinja").read_text())
    fmt, _ = choose(tok, "auto", name)
    assert fmt.parser == "mistral_args"
    prompt = tok(fmt.render([{"role": "user", "content": "hi"}], [], True), add_special_tokens=False)["input_ids"]
    for text, want in [("[THINK]I'm\nthinking[/THINK]Hello, world!\nWhat's up?", ("Hello, world!\nWhat's up?", [])),  # test-chat.cpp
                       ('[THINK]I\'m\nthinking[/THINK][TOOL_CALLS]special_function[ARGS]{"arg1":1}',  # test-chat.cpp
                        ("", [("special_function", {"arg1": 1})])),
                       ('[THINK]Maybe [TOOL_CALLS]special_function[ARGS]{"arg1":1}[/THINK]No.', ("No.", [])),
                       ('[TOOL_CALLS]special_function[ARGS]{"arg1": 1}[TOOL_CALLS]special_function_with_opt[ARGS]{"arg1": 1, "arg2": 2}',
                        ("", [("special_function", {"arg1": 1}), ("special_function_with_opt", {"arg1": 1, "arg2": 2})]))]:
        content, calls = fmt.parse_turn(tok(text, add_special_tokens=False)["input_ids"], prompt, set())
        assert (content, [(c.name, c.arguments) for c in calls]) == want, text


def test_named_templates_record_the_tool_use_one_a_tool_run_renders(assets):
    """Hermes-2-Pro's and Hermes-3's tokenizers ship named templates, `default` and `tool_use`;
    transformers renders `tool_use` whenever `tools=` is passed, as every tool run's rendering is.
    The template a tool run records (the rollout manifest's sha256) is that one. Was: the `default`
    one's, a template the run never rendered with tools."""
    from pipeline.agents.format import ToolFormat
    from pipeline.agents.probe import choose
    from pipeline.agents.templates import ChatTemplate, template_sha256

    tool_use = (LLAMA_CPP / "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja").read_text()
    default = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = llama_cpp_tokenizer(Path(assets["model"]), tool_use)
    tok.chat_template = {"default": default, "tool_use": tool_use}
    fmt, note = choose(tok, "auto", "hermes-2-pro")
    assert (fmt.kind, fmt.parser, note) == ("template", "hermes", None)
    schema = {"type": "function", "function": {"name": "multiply", "description": "x", "parameters": {"type": "object", "properties": {}}}}
    assert "<tools>" in fmt.render([{"role": "user", "content": "hi"}], [schema], True)  # rendered with tool_use
    assert fmt.template.record() == {"name": "model", "sha256": template_sha256(tool_use)}
    # an episode with no tools (an environment without methods) where `tool_use` is the only template:
    # it iterates `tools` and cannot render None (TRL's `tools or None`), so it gets an empty list;
    # Qwen keeps None (Llama 3.x would render tool boilerplate for an empty list)
    alone = ToolFormat(llama_cpp_tokenizer(Path(assets["model"]), tool_use), "template", template=ChatTemplate("model", None, ""))
    assert alone.render([{"role": "user", "content": "hi"}], [], True).endswith("<|im_start|>assistant\n")
    text = (LLAMA_CPP / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    qwen = ToolFormat(tok, "template", template=ChatTemplate("qwen", text, template_sha256(text)))
    assert qwen.conversation([{"role": "user", "content": "hi"}], [])[1] == {"tools": None}


def test_the_end_of_turn_of_a_template_that_needs_tools_is_read(assets):
    """Hermes-2-Pro's and Hermes-3's `tool_use` templates loop over `tools` and fail without them:
    the end of turn (a stop token, and what the probe cuts off the sample turn) is read off a rendering
    with a tool, as the probe renders them. Was: None, so a run stopped only on the tokenizer's eos."""
    from pipeline.models.stop_tokens import end_of_turn

    for name in ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use"):
        tok = llama_cpp_tokenizer(Path(assets["model"]), (LLAMA_CPP / f"{name}.jinja").read_text())
        tok.add_special_tokens({"eos_token": "<|end_of_text|>"})  # the Llama 3 base's eos, not the template's end of turn
        assert end_of_turn(tok) == "<|im_end|>", name


def test_lfm2_string_values_read_raw_as_the_template_writes_them(assets):
    """LFM2.5's templates write a string argument raw between single quotes (`'" + value + "'"`, no
    escapes): a value with a newline or a backslash (code, paths) is written as is, and TRL 1.16's lfm2
    response template reads it back as is (strings in a list are Python's repr, escapes and all). A call the template writes parses back to the same
    arguments. Was: a newline in a value made the call malformed (a Python literal cannot hold one), and
    a backslash was read as an escape (`a\\nb` became a newline)."""
    from pipeline.agents.probe import choose

    for tok in (with_template(Path(assets["model"]), trl_templates()["lfm2_2_5"]),
                llama_cpp_tokenizer(Path(assets["model"]), (LLAMA_CPP / "LFM2.5-8B-A1B.jinja").read_text())):
        fmt, _ = choose(tok, "auto", "lfm")
        assert fmt.parser == "pythonic"
        user = {"role": "user", "content": "hi"}
        args = {"code": "def f():\n    return 'ok'", "path": "C:\\new\\table", "n": 3, "meta": {"q": "it's \"x\""},
                "tags": ["a\nb", "C:\\x", "it's"]}  # a list: written by Jinja's `string` filter, with Python's escapes
        said = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "run", "arguments": args}}]}
        full = tok.apply_chat_template([user, said], tokenize=False)
        text = full[full.index("<|tool_call_start|>"): full.index("<|tool_call_end|>") + len("<|tool_call_end|>")]
        assert "\n    return 'ok'" in text  # written raw
        content, calls = fmt.parse(text, "")
        assert (content, [(c.name, c.arguments) for c in calls]) == ("", [("run", args)]), text
