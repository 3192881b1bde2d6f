"""A model directory's tokenizer, loaded once per process for the same bytes.

Every policy directory of a run carries the same tokenizer files, and a warm `grpo iterate` asked
transformers to parse them (0.1-0.4 s for SmolLM2's 2 MB tokenizer.json on a loaded CPU) twice an
iteration: for the rollout's prompts and for the sampler proof's probe. `tokenizer_of` keys its
cache on the sha256 of the directory's files other than weights (4 ms: the tokenizer, its config,
the chat template, the model's config.json), so a directory whose tokenizer files differ in any
byte gets its own load, and each caller gets its own shallow copy: setting an attribute on it
(`template_date.dated` wraps `apply_chat_template`) leaves the cached one as loaded.
"""

from __future__ import annotations

import copy
import hashlib
import threading
from collections import OrderedDict
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")
"""Files a tokenizer never reads (a policy's weights file may still be being written beside them)."""
KEEP = 4
"""Distinct tokenizers held (a run has one; an eval against another model, a few)."""

_CACHE: OrderedDict[str, object] = OrderedDict()
_LOCK = threading.Lock()


def files_key(model_dir: Path) -> str:
    """sha256 over the names and bytes of `model_dir`'s top-level files other than weights and MANIFEST.json."""
    h = hashlib.sha256()
    for p in sorted(Path(model_dir).iterdir()):
        if not p.is_file() or p.name.endswith(WEIGHT_SUFFIXES) or p.name == "MANIFEST.json" or p.name.startswith("."):
            continue
        h.update(p.name.encode() + b"\0")
        h.update(p.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def tokenizer_of(model_dir: Path):
    """`AutoTokenizer.from_pretrained(model_dir)`, from the cache when its files' bytes were loaded before (a shallow copy)."""
    from transformers import AutoTokenizer

    key = files_key(model_dir)
    with _LOCK:
        tok = _CACHE.get(key)
        if tok is not None:
            _CACHE.move_to_end(key)
    if tok is None:
        tok = AutoTokenizer.from_pretrained(model_dir)
        with _LOCK:
            _CACHE[key] = tok
            while len(_CACHE) > KEEP:
                _CACHE.popitem(last=False)
    tok = copy.copy(tok)
    tok.name_or_path = str(model_dir)  # where this caller's files are (the cached one's may be gone): GRPO_TOKENIZER names it
    return tok
