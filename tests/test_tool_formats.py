"""Tool calls in the formats models write them, and turns that end in any stop token.

Each chat template here has the shape of a real model family's (Qwen3-Coder / Qwen3.5, GLM-4.5,
Mistral, Llama 3.1), reduced to what decides the format, on a small byte-level tokenizer built
here (demo.tinymodel's) with the family's markers added as tokens. A call is rendered through the
template and must parse back from its token ids to the same name and arguments.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# ----------------------------------------------------------------------------- templates
QWEN35_LIKE = (  # Qwen3.5 / Qwen3-Coder: XML calls inside <tool_call>, results as user turns, an empty think block prefilled
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n<think>\n\n</think>\n\n{{ m.content }}"
    "{%- for tc in m.tool_calls or [] %}{% set f = tc.function %}"
    "{%- if loop.first and m.content %}\n\n{% elif not loop.first %}\n{% endif %}"
    "<tool_call>\n<function={{ f.name }}>\n"
    "{%- for k, v in f.arguments | items %}<parameter={{ k }}>\n"
    "{{- v | tojson if v is mapping or (v is sequence and v is not string) else v | string }}\n</parameter>\n{% endfor %}"
    "</function>\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}{% if loop.previtem.role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ m.content }}\n</tool_response>{% if loop.last or loop.nextitem.role != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}"
)

GLM_LIKE = (  # GLM-4.5: <arg_key>/<arg_value> calls, no end-of-turn token; the result's <|observation|> is a stop token
    "[gMASK]<sop>{% if tools %}<|system|>\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}<|user|>\n{{ m.content }}"
    "{%- elif m.role == 'assistant' %}<|assistant|>\n<think></think>{% if m.content %}\n{{ m.content }}{% endif %}"
    "{%- for tc in m.tool_calls or [] %}{% set f = tc.function %}\n<tool_call>{{ f.name }}\n"
    "{%- for k, v in f.arguments | items %}<arg_key>{{ k }}</arg_key>\n<arg_value>{{ v | tojson if v is not string else v }}</arg_value>\n{% endfor %}"
    "</tool_call>{% endfor %}"
    "{%- elif m.role == 'tool' %}{% if loop.previtem.role != 'tool' %}<|observation|>{% endif %}\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{%- endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)

LAST_USER = "{%- set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
MISTRAL_LIKE = (  # Mistral 7B v0.3: [TOOL_CALLS] and a JSON list of calls whose ids must be 9 alphanumerics
    "<s>" + LAST_USER + "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{% if tools and loop.index0 == ns.last %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST] {{ m.content }}[/INST]"
    "{%- elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS] ["
    "{%- for tc in m.tool_calls %}"
    "{%- if tc.id is not string or tc.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}, "id": "{{ tc.id }}"}'
    "{%- if not loop.last %}, {% endif %}{% endfor %}]</s>"
    "{%- elif m.role == 'assistant' %} {{ m.content }}</s>"
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS] {{ {'content': m.content, 'call_id': m.tool_call_id} | tojson }}[/TOOL_RESULTS]"
    "{%- endif %}{% endfor %}"
)

MISTRAL_ARGS_LIKE = (  # Mistral Small 3.2 / Magistral / Devstral: [TOOL_CALLS]name[ARGS]{...} per call
    "<s>" + LAST_USER + "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{% if tools and loop.index0 == ns.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST]{{ m.content }}[/INST]"
    "{%- elif m.role == 'assistant' %}{{ m.content }}"
    "{%- for tc in m.tool_calls or [] %}[TOOL_CALLS]{{ tc.function.name }}[ARGS]{{ tc.function.arguments | tojson }}{% endfor %}</s>"
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{%- endif %}{% endfor %}"
)

LLAMA31_LIKE = (  # Llama 3.1: bare JSON calls ending <|eot_id|>; <|eom_id|> is a stop token the template never renders here
    "<|begin_of_text|>{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    '{%- for tc in m.tool_calls %}{"name": "{{ tc.function.name }}", "parameters": {{ tc.function.arguments | tojson }}}{% endfor %}<|eot_id|>'
    "{%- elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

REPR_LIKE = (  # a template that writes <tool_call> blocks as Python reprs: not JSON, so nothing reads them back
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for tc in m.tool_calls or [] %}<tool_call>\n{{ tc.function | string }}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

FAMILY_TOKENS = {  # the markers each family's tokenizer has as special tokens, and its end-of-turn (eos)
    "qwen": (["<tool_call>", "</tool_call>", "<think>", "</think>"], "<|im_end|>", False),
    "glm": (["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"], "<|user|>", True),
    "mistral": (["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[ARGS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
                 "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"], "</s>", True),
    "llama": (["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
              "<|eot_id|>", True),
}

TOOLS = '''
def multiply(a: int, b: int) -> str:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return str(a * b)


def note(text: str, tags: list) -> str:
    """Keep a note.

    Args:
        text: what to keep
        tags: labels for it
    """
    return f"kept {text!r} {tags}"
'''


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from demo.tinymodel import build_tokenizer

    texts = ["multiply the numbers a and b", "keep a note with text and tags", "the answer is 42", "two lines of text"] * 4
    path = tmp_path_factory.mktemp("format-tokenizer")
    build_tokenizer(texts).save_pretrained(path)
    return path


@pytest.fixture
def make_tokenizer(tokenizer_dir):
    def make(family: str, template: str):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        markers, eos, special = FAMILY_TOKENS[family]
        if special:
            tok.add_special_tokens({"additional_special_tokens": markers + [eos]}, replace_extra_special_tokens=False)
        else:
            tok.add_tokens(markers)
        tok.eos_token = eos
        tok.chat_template = template
        return tok
    return make


@pytest.fixture(scope="module")
def schemas(tmp_path_factory):
    """({name: tool}, [their schemas], the tools' file)."""
    from pipeline.agents.tools import load_tools, tool_schema

    path = tmp_path_factory.mktemp("format-tools") / "format_tools.py"
    path.write_text(TOOLS)
    fns = load_tools([f"{path}:multiply", f"{path}:note"])
    return {f.__name__: f for f in fns}, [tool_schema(f, "t") for f in fns], path


def assistant_part(fmt, call_msg: dict, schemas: list) -> str:
    """What the model writes for `call_msg`: the rendering with it, after the prompt's generation prompt."""
    user = [{"role": "user", "content": "multiply 6 by 7"}]
    prompt = fmt.render(user, schemas, True)
    full = fmt.render(user + [call_msg], schemas, False)
    assert full.startswith(prompt)
    return full[len(prompt):]


CALLS = [{"name": "multiply", "arguments": {"a": 6, "b": 7}},
         {"name": "note", "arguments": {"text": "two\nlines", "tags": ["x", "y"]}}]


@pytest.mark.parametrize("family,template,parser", [
    ("qwen", QWEN35_LIKE, "qwen_xml"),
    ("glm", GLM_LIKE, "glm"),
    ("mistral", MISTRAL_LIKE, "mistral_list"),
    ("mistral", MISTRAL_ARGS_LIKE, "mistral_args"),
])
def test_calls_parse_back_in_the_models_own_format(make_tokenizer, schemas, family, template, parser):
    """Two calls (integers, a multi-line string, a list) rendered by the template, sampled as the
    model would write them (its tokens up to the stop token), parse back to the same calls; the
    XML families give the raw strings the model wrote, which the tool's schema then types."""
    from pipeline.agents.execution import cast_arguments, parameters
    from pipeline.agents.probe import choose

    tools, specs, _ = schemas
    tok = make_tokenizer(family, template)
    fmt, note = choose(tok, "auto", f"{family}-like")
    assert (fmt.kind, fmt.parser, note) == ("template", parser, None)
    msg = {"role": "assistant", "content": "Let me compute.", "tool_calls": CALLS}
    turn = assistant_part(fmt, msg, specs)
    body = turn.rstrip()[: -len(tok.eos_token)] if turn.rstrip().endswith(tok.eos_token) else turn.rstrip()
    ids = tok(body, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # the turn as sampled
    prompt_ids = tok(fmt.render([{"role": "user", "content": "multiply 6 by 7"}], specs, True), add_special_tokens=False)["input_ids"]
    content, calls = fmt.parse_turn(ids, prompt_ids, {tok.eos_token_id})
    assert [c.name for c in calls] == ["multiply", "note"]
    by_name = {s["function"]["name"]: parameters(s) for s in specs}
    assert [cast_arguments(by_name[c.name], c.arguments) for c in calls] == [c["arguments"] for c in CALLS]
    if parser in ("qwen_xml", "glm"):  # values as written: strings until the schema types them
        assert calls[0].arguments == {"a": "6", "b": "7"} and calls[1].arguments["text"] == "two\nlines"
    if family == "mistral":  # the marker is a special token: a decode that skips them loses every call
        assert "[TOOL_CALLS]" not in tok.decode(ids, skip_special_tokens=True)
    # the assistant's words stay the content (Mistral's list form carries none beside its calls)
    assert content == ("" if parser == "mistral_list" else "Let me compute.")
    # what is not a call stays the answer; a call cut off or without a name is malformed, never dropped
    plain = tok("the answer is 42", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert fmt.parse_turn(plain, prompt_ids, {tok.eos_token_id}) == ("the answer is 42", [])
    cut = tok(body[: body.index(CALLS[1]["name"]) + 8], add_special_tokens=False)["input_ids"]
    _, calls = fmt.parse_turn(cut, prompt_ids, {tok.eos_token_id})
    assert [c.name for c in calls] == ([None] if parser == "mistral_list" else ["multiply", None])  # one JSON list: all or none


def test_a_format_that_does_not_round_trip_is_refused_at_init(make_tokenizer, assets, schemas, tmp_path, capsys):
    """A template whose sample call does not parse back to the same call is refused by `grpo
    init` in one line naming the model and the format, instead of answering every call of the
    run with "malformed"; rollout.tool_format: hermes, the way out the line names, is accepted."""
    import shutil

    from conftest import base_config, init_error_line, write_config
    from pipeline.agents.probe import choose

    assert choose(make_tokenizer("qwen", REPR_LIKE), "hermes", "repr-model")[0].kind == "hermes"
    model = tmp_path / "repr-model"
    shutil.copytree(assets["model"], model)
    (model / "chat_template.jinja").write_text(REPR_LIKE)
    tools_py = tmp_path / "format_tools.py"
    tools_py.write_text(TOOLS)
    cfg = base_config(assets, model=str(model), rollout={"tools": [f"{tools_py}:multiply"]})
    line = init_error_line(capsys, tmp_path / "run", "--config", write_config(tmp_path / "cfg.yaml", cfg))
    assert line.startswith("rollout.tools: the chat template of ") and str(model) in line
    assert "the hermes call format" in line and "does not parse back" in line and "rollout.tool_format: hermes" in line


def forced(tok, text: str, stop: str):
    """A model turn that wrote `text` and ended with the stop token `stop` (logprob -0.5 each)."""
    from pipeline.models.engine_base import Sample

    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids(stop)]
    return Sample(text, ids, [-0.5] * len(ids), "stop")


@pytest.mark.parametrize("family,template,stops,first,other_stop", [
    # Qwen: generation_config's eos is [<|im_end|>, <|endoftext|>]; the template renders only <|im_end|>
    ("qwen", QWEN35_LIKE, ["<|im_end|>", "<|endoftext|>"],
     "<tool_call>\n<function=multiply>\n<parameter=a>\n6\n</parameter>\n<parameter=b>\n7\n</parameter>\n</function>\n</tool_call>",
     "<|endoftext|>"),
    # Llama 3.1: <|eom_id|> ends a turn that called a tool; the template writes <|eot_id|> after a call
    ("llama", LLAMA31_LIKE, ["<|eot_id|>", "<|eom_id|>"], '<|python_tag|>{"name": "multiply", "parameters": {"a": 6, "b": 7}}',
     "<|eom_id|>"),
    # GLM: the turn ends in <|observation|>, which the template renders as the start of the result
    ("glm", GLM_LIKE, ["<|user|>", "<|observation|>"],
     "\n<think></think>\n<tool_call>multiply\n<arg_key>a</arg_key>\n<arg_value>6</arg_value>\n<arg_key>b</arg_key>\n<arg_value>7</arg_value>\n</tool_call>",
     "<|observation|>"),
])
def test_a_turn_ending_in_any_stop_token_goes_on(make_tokenizer, schemas, tmp_path, family, template, stops, first, other_stop):
    """A turn that ends in a stop token the template does not render after an assistant message
    continues to the next turn: its tokens stay as sampled (mask 1), the glue follows (mask 0), and
    the record's tokens, mask and text agree; the same turn ending in the template's own end of
    turn gets the same glue, less that token where the template renders it."""
    from pipeline.agents.episode import EpisodeRunner
    from pipeline.agents.setup import load_agents
    from pipeline.config.data import DataConfig
    from pipeline.data.prompts import Prompt
    from pipeline.config.rollout import RolloutConfig

    _, specs, tools_py = schemas
    tok = make_tokenizer(family, template)
    if other_stop not in tok.get_vocab():
        tok.add_special_tokens({"additional_special_tokens": [other_stop]}, replace_extra_special_tokens=False)
    model_dir = tmp_path / "model"  # the stop tokens the model can sample: its generation config's eos ids
    model_dir.mkdir()
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.convert_tokens_to_ids(s) for s in stops]}))
    cfg = RolloutConfig(tools=[f"{tools_py}:multiply"], max_new_tokens=64, max_turns=3, max_episode_tokens=1024)
    agents = load_agents(cfg, tok, model_dir, f"{family}-like")
    fmt = agents.format
    runner = EpisodeRunner(agents, tok, cfg, DataConfig(train="unused.jsonl"), 4096)
    prompt = Prompt(0, "multiply 6 by 7", "", [], {})
    e = runner.start(prompt, 0, 0, 123, "test")
    t1 = forced(tok, first, other_stop)
    assert runner._after_turn(e, t1, 64)  # the call ran and the episode goes on
    glue = e.texts[1]
    assert e.messages[0]["tool_calls"][0]["function"]["name"] == "multiply" and e.messages[1]["content"] == "42"
    assert e.messages[1]["error"] is None
    t2 = forced(tok, "the answer is 42", stops[0])
    assert not runner._after_turn(e, t2, 64)
    row = runner.row(e, "h")
    rec = json.loads(row["episode"])
    glue_ids = tok(glue, add_special_tokens=False)["input_ids"]
    ids, mask = row["completion_ids"], row["completion_mask"]
    assert ids == t1.token_ids + glue_ids + t2.token_ids  # the sampled stop token kept exactly
    assert mask == [1] * len(t1.token_ids) + [0] * len(glue_ids) + [1] * len(t2.token_ids)
    assert rec["ending"] == "answered" and rec["turns"] == 2 and rec["model_tokens"] == sum(mask)
    assert rec["context_tokens"] == len(glue_ids) and "42" in glue and other_stop not in glue
    # the template's own rendering of the conversation, from the end of the call on, is the glue
    msgs = [{"role": "user", "content": "multiply 6 by 7"},
            {"role": "assistant", "content": "", "tool_calls": [{"name": "multiply", "arguments": {"a": 6, "b": 7}}]},
            {"role": "tool", "name": "multiply", "content": "42"}]
    assert glue in fmt.render(msgs, specs[:1], True)
    # the same turn ended by the template's end of turn (or the token the glue starts with) gets the same glue
    stop_text = stops[0] if family != "glm" else other_stop
    assert fmt.glue_text(msgs, 1, specs[:1], stop_text, True) == glue


# ------------------------------------------------------------------ where a model's turn ends

@pytest.mark.parametrize("family,template,listed,eos,end_of_turn", [
    # Qwen2.5 base-style files: generation_config and the tokenizer name <|endoftext|>; the template closes turns with <|im_end|>
    ("qwen", QWEN35_LIKE, ["<|endoftext|>"], "<|endoftext|>", "<|im_end|>"),
    # Llama 3.x files that list <|eom_id|> only: the template closes turns with <|eot_id|>
    ("llama", LLAMA31_LIKE, ["<|eom_id|>"], "<|eom_id|>", "<|eot_id|>"),
    # Mistral: </s> closes an assistant turn, whatever generation_config lists
    ("mistral", MISTRAL_LIKE, [], "</s>", "</s>"),
    # GLM writes no token after an assistant message (the next header ends it): its listed stop tokens alone
    ("glm", GLM_LIKE, ["<|user|>", "<|observation|>"], "<|user|>", None),
])
def test_stop_ids_are_the_eos_ids_and_the_templates_end_of_turn(make_tokenizer, tmp_path, family, template, listed, eos,
                                                                end_of_turn):
    """The ids that end a completion: generation_config's eos ids, the tokenizer's eos and the
    special token the chat template closes an assistant message with, found by rendering one."""
    from pipeline.models.stop_tokens import end_of_turn as derived_end_of_turn
    from pipeline.models.stop_tokens import stop_token_ids

    tok = make_tokenizer(family, template)
    tok.eos_token = eos
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.convert_tokens_to_ids(s) for s in listed]}))
    assert derived_end_of_turn(tok) == end_of_turn
    want = {tok.convert_tokens_to_ids(s) for s in [*listed, eos, *([end_of_turn] if end_of_turn else [])]}
    assert stop_token_ids(tmp_path, tok) == sorted(want)


def test_stop_ids_without_generation_config_or_template(make_tokenizer, tmp_path):
    """No generation_config.json: config.json's eos_token_id, as transformers and vLLM fall back
    to it; no chat template: nothing to derive an end of turn from, the eos ids alone."""
    from pipeline.models.stop_tokens import stop_token_ids

    tok = make_tokenizer("qwen", QWEN35_LIKE)
    pad, im_end = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": pad}))
    assert stop_token_ids(tmp_path, tok) == sorted({pad, im_end})
    tok.chat_template = None
    tok.eos_token = "<|endoftext|>"
    assert stop_token_ids(tmp_path, tok) == [pad]


def test_completions_end_at_the_templates_end_of_turn_and_the_manifest_records_it(assets, make_run, tmp_path):
    """A model whose generation_config.json does not list its template's end-of-turn token still
    ends each completion there: the HF engine stops on it (the token kept, as sampled and as the
    trainer scores it), and the manifest's inputs (stamped into every part) record the stop ids;
    a rerun derives the same ones, so it stamps, and writes, the same parts."""
    import pyarrow.parquet as pq
    from conftest import unlisted_end_of_turn
    from transformers import AutoTokenizer

    from pipeline.rollout import RolloutInputs, run_rollout
    from pipeline.run.parts import input_hash
    from pipeline.run.run import Run

    model = unlisted_end_of_turn(Path(assets["model"]), tmp_path / "unlisted")
    tok = AutoTokenizer.from_pretrained(model)
    pad, im_end = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")
    rollout = {"engine": "hf", "prompts_per_iter": 2, "max_new_tokens": 24}
    run, again = (Run(make_run(name, model=str(model), rollout=rollout)) for name in ("a", "b"))
    m = run_rollout(run, 0)
    rows = [r for p in sorted((Path(run.uri) / "iter-0000/rollout").glob("part-*.parquet")) for r in pq.read_table(p).to_pylist()]
    assert sum(r["finish_reason"] == "stop" for r in rows) >= len(rows) // 2, [r["completion"] for r in rows]  # ~9 tokens each
    for r in rows:
        ids = r["completion_ids"]
        assert im_end not in ids[:-1], r["completion"]  # no turn runs on past its end
        assert (ids[-1] == im_end) == (r["finish_reason"] == "stop") == (not r["truncated"])
        assert len(r["sampler_logprobs"]) == len(ids)  # the stop token's logprob too: the trainer scores what was sampled
    assert m.inputs["stop_token_ids"] == sorted({pad, im_end})
    assert input_hash(again.cfg_hash, "rollout", 0, RolloutInputs(again, 0).inputs()) == m.input_hash
