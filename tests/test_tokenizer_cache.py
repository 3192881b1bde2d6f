"""pipeline.models.tokenizer_cache: one load per tokenizer bytes, never a stale one."""

import json
import shutil

from pipeline.models.tokenizer_cache import files_key, tokenizer_of

TEXT = "Q: 17 + 25 = ? A: 42"


def test_same_bytes_load_once_and_each_caller_owns_its_copy(assets, tmp_path):
    from transformers import AutoTokenizer

    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(assets["model"], a)
    shutil.copytree(assets["model"], b)
    (b / "model.safetensors").write_bytes(b"another policy's weights")  # weights are not the tokenizer's
    first, second = tokenizer_of(a), tokenizer_of(b)
    assert files_key(a) == files_key(b)
    assert first is not second and first._tokenizer is second._tokenizer  # one parse, two copies
    assert (first.name_or_path, second.name_or_path) == (str(a), str(b))  # each names its caller's files (GRPO_TOKENIZER)
    assert second(TEXT)["input_ids"] == AutoTokenizer.from_pretrained(a)(TEXT)["input_ids"]
    first.apply_chat_template = None  # what template_date.dated does to its copy
    assert tokenizer_of(a).apply_chat_template is not None


def test_changed_tokenizer_files_are_loaded_again(assets, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(assets["model"], a)
    shutil.copytree(assets["model"], b)
    conf = json.loads((b / "tokenizer_config.json").read_text())
    conf["model_max_length"] = 77
    (b / "tokenizer_config.json").write_text(json.dumps(conf))
    assert files_key(a) != files_key(b)
    assert tokenizer_of(b).model_max_length == 77
    assert tokenizer_of(a).model_max_length != 77
