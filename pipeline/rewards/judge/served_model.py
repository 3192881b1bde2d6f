"""A served `reward_model`: a sequence-classification (or reward) model behind vLLM's pooling
server, asked for each completion's logits, every answer recorded as the judge's are.

    vllm serve MODEL --runner pooling --served-model-name toxicity --max-model-len 512

    rewards:
      - fn: reward_model
        max_concurrency: 8
        kwargs: {model: toxicity, base_url: http://127.0.0.1:8002/v1, label: 1, activation: softmax, sign: -1}

The text is what the in-process `reward_model` (pipeline.rewards.builtins) scores: prompt +
completion for a plain prompt, sent as `input`; for a chat prompt its messages and the completion
as an assistant message, sent as `messages`, so that the server applies the model's chat template
as the in-process path applies the tokenizer's; the completion alone with use_prompt false (an
episode's completion: its assistant messages, newline-joined). `use_activation: false` asks for
the raw logits, and the reward is read from them here as in-process:
sign * activation(logits)[label]. The answer stored is the logits as a JSON list, so that an
audit reads it again to the same reward.

vLLM serves /classify beside /v1, not under it: the URL is base_url without its /v1, + /classify.

A server that does not know `use_activation` (vLLM named it `activation` in earlier releases;
unknown fields are ignored there with a warning) answers probabilities, and the activation here
would be applied a second time. So before its first request a scoring (and `grpo init`) sends one
probe text twice, with `use_activation` false and true (`probe_body`): the same answer both times,
shaped as probabilities (each in [0, 1], summing to 1 for two labels or more), means the field is
ignored, and the reward stops with one line instead of being read wrong (`check_obeyed`).
"""

from __future__ import annotations

import json
import math

from pipeline.errors import GRPOError
from pipeline.rewards.judge.client import Answer, ask, joined

PROBE = "Is this text classified?"
"""The text sent twice to a served reward model's server to see whether it obeys `use_activation`."""


def classify_url(base_url: str) -> str:
    """vLLM's /classify: at the server's root (base_url without a trailing /v1), its query kept."""
    return joined(base_url, "classify", strip="/v1")


def _said(completion) -> str:
    from pipeline.rewards.builtins import model_text

    return model_text(completion)  # an episode's assistant messages, as in-process


def request_body(o, prompt, completion) -> str:
    """The /classify request for one completion, canonical JSON: what is sent, stored and hashed."""
    said = _said(completion)
    body: dict = {"model": o.model, "use_activation": False, "truncate_prompt_tokens": o.max_length}
    if not o.use_prompt:
        body["input"] = said
    elif isinstance(prompt, str):
        body["input"] = prompt + said
    else:
        body["messages"] = [{"role": m.get("role"), "content": m.get("content")} for m in prompt] + \
                           [{"role": "assistant", "content": said}]
    return json.dumps(body, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def probe_body(o, use_activation: bool) -> str:
    """The probe request: PROBE, with `use_activation` as given."""
    body = {"model": o.model, "input": PROBE, "use_activation": use_activation, "truncate_prompt_tokens": o.max_length}
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


def check_obeyed(what: str, raw: list, activated: list) -> None:
    """Stop when the server answered the probe the same with use_activation false and true, with
    probabilities: it ignores the field, and its answers are not logits."""
    if raw != activated or not _probabilities(raw):
        return  # it obeys (or it applies no activation either way: its answers are logits)
    shown = ", ".join(f"{x:.4g}" for x in raw)
    raise GRPOError(f"{what}: the server ignores use_activation: false (the same text gets [{shown}] with it and without "
                    f"it: probabilities, not logits), so the activation would be applied twice; serve the model with a "
                    f"vLLM whose /classify knows use_activation, or score it in-process (no base_url)")


def _probabilities(x: list) -> bool:
    if not x or not all(isinstance(v, int | float) and math.isfinite(v) and 0.0 <= v <= 1.0 for v in x):
        return False
    return len(x) == 1 or abs(sum(x) - 1.0) < 1e-4


def classification_answer(data: dict) -> Answer:
    """The first item's logits (vLLM names them `probs`; raw with use_activation false), as JSON."""
    item = data["data"][0]
    usage = data.get("usage") or {}
    return Answer(text=json.dumps(item["probs"]), latency_s=0.0, prompt_tokens=usage.get("prompt_tokens"),
                  completion_tokens=None, server_model=data.get("model"), attempts=0)


def read_logits(answer: str | None, o) -> tuple[float | None, str | None]:
    """sign * activation(logits)[label] from a stored answer, or None and why not:
    "not logits", "not finite", "no label <i>"."""
    try:
        logits = json.loads(answer or "")
    except (ValueError, TypeError):
        return None, "not logits"
    if not isinstance(logits, list) or not logits or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in logits):
        return None, "not logits"
    x = [float(v) for v in logits]
    if not all(math.isfinite(v) for v in x):
        return None, "not finite"
    if not 0 <= o.label < len(x):
        return None, f"no label {o.label} ({len(x)} logits)"
    if o.activation == "softmax":
        top = max(x)
        exps = [math.exp(v - top) for v in x]
        x = [e / sum(exps) for e in exps]
    elif o.activation == "sigmoid":
        x = [1.0 / (1.0 + math.exp(-v)) if v >= 0 else math.exp(v) / (1.0 + math.exp(v)) for v in x]
    return o.sign * x[o.label], None


class ServedClassifier:
    """How a served `reward_model` asks: one /classify request per completion, the reward read from its logits."""

    kind = "classification"

    def __init__(self, o):
        self.o = o
        self.url = classify_url(o.base_url)
        self.what = f"reward model {o.model} at {o.base_url}"

    def bodies(self, prompts: list, completions: list, columns: dict[str, list], where: str,
               rendered: list[str] | None = None, recorded: list[str] | None = None) -> list[str]:
        return [request_body(self.o, p, c) for p, c in zip(prompts, completions)]

    @staticmethod
    def parse(data: dict) -> Answer:
        return classification_answer(data)

    async def prepare(self, client, hdrs: dict, spec) -> None:
        """The probe (module docstring): raises GRPOError when the server ignores use_activation,
        JudgeFailure when it does not answer."""
        raw, activated = [json.loads((await ask(client, self.url, probe_body(self.o, flag), hdrs, spec.timeout_s, spec.retries,
                                                self.parse, self.kind)).text) for flag in (False, True)]
        check_obeyed(self.what, raw, activated)

    def read(self, answer: str | None, finish_reason: str | None = None) -> tuple[float | None, str | None]:
        return read_logits(answer, self.o)
