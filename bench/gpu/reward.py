"""The GPU proof's reward, written as a TRL user writes one: the share of a completion's characters
that are ASCII letters or spaces. A random model's completions differ in it, so groups have spread
and the update has advantages to follow."""


def letters(prompts, completions, **kwargs) -> list[float]:
    out = []
    for c in completions:
        text = c if isinstance(c, str) else c[-1]["content"]
        out.append(sum(ch.isascii() and (ch.isalpha() or ch == " ") for ch in text) / max(len(text), 1))
    return out
