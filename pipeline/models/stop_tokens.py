"""The token ids that end a completion (one model turn), decided once for a model directory.

    stop ids = generation_config.json's eos ids ∪ the tokenizer's eos ∪ the template's end of turn

Both engines stop on exactly these (vLLM as `stop_token_ids`, `generate` as its eos ids), the
HF engine cuts a row at the first of them, an episode counts a turn as ended by them, and the
rollout records them in its manifest's inputs (so they are stamped into every part). The
token that stopped a completion stays in it, as sampled: the trainer scores and trains on the
same tokens the engine sampled, so logprobs and loss masks end where the completion does.

Why the template: a model directory's files often name only the pre-training eos (Qwen2.5's
base-style files `<|endoftext|>`, some Llama 3 files `<|end_of_text|>`) while its chat template
closes each assistant message with another special token (`<|im_end|>`, `<|eot_id|>`). A model
trained on that template writes the latter at the end of its turn; an engine that does not stop
there samples on past the answer until rollout.max_new_tokens. The end of turn is read off the
template itself (an assistant message rendered through `apply_chat_template`, and the special
token right after it), not from a list of model families.
"""

from __future__ import annotations

import json
from pathlib import Path

_SENTINEL = "tool_content_c4f9a8e2"  # a text no template writes of its own
_TOOL = {"type": "function", "function": {"name": "probe", "description": "probe", "parameters": {"type": "object", "properties": {}}}}


def end_of_turn(tokenizer) -> str | None:
    """The special token the template writes right after an assistant message (`<|im_end|>`,
    `<|eot_id|>`, `</s>`), or None (GLM's templates write none: the next message's header ends
    it; a tokenizer without a chat template)."""
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}]
    text = None
    for tools in (None, [_TOOL]):  # a template that loops over `tools` fails without them (Hermes-2-Pro's tool_use)
        try:
            text = tokenizer.apply_chat_template(chat, tokenize=False, tools=tools)
            break
        except Exception:  # no template, or one that refuses this conversation
            continue
    if not isinstance(text, str) or _SENTINEL not in text:
        return None
    tail = text[text.rindex(_SENTINEL) + len(_SENTINEL):].lstrip()
    specials = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special} | set(tokenizer.all_special_tokens)
    return next((t for t in sorted(specials, key=len, reverse=True) if t and tail.startswith(t)), None)


def listed_eos_ids(model_dir: Path) -> list[int]:
    """The eos ids the model directory's files list, as transformers and vLLM read them:
    generation_config.json's, or config.json's where there is no generation_config.json."""
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            return [int(x) for x in (eos if isinstance(eos, list) else [eos] if eos is not None else [])]
    return []


def stop_token_ids(model_dir: Path, tokenizer) -> list[int]:
    """Every token id that ends a completion of the model in `model_dir` (sorted): see the module
    docstring. `tokenizer`: the directory's own."""
    ids = set(listed_eos_ids(model_dir))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    eot = end_of_turn(tokenizer)
    if eot is not None:
        ids.add(int(tokenizer.convert_tokens_to_ids(eot)))
    return sorted(ids)
