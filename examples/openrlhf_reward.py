"""A reward function in OpenRLHF's `--remote_rm_url file.py` contract, as an OpenRLHF user writes it:
used unchanged by examples/openrlhf.yaml (`contract: openrlhf`, docs/rewards.md#openrlhf).

queries: the rendered prompt followed by the completion; prompts: the rendered prompt; labels: the
column `kwargs.label_key` names (here the demo data's `answer`)."""

import re


def reward_func(queries, prompts, labels, **kwargs):
    rewards, found = [], []
    for query, prompt, label in zip(queries, prompts, labels):
        response = query[len(prompt):] if query.startswith(prompt) else query
        m = re.findall(r"<answer>(.*?)</answer>", response, re.S)
        answer = m[-1].strip() if m else None
        rewards.append(1.0 if answer is not None and answer == str(label).strip() else 0.0)
        found.append(1.0 if answer is not None else 0.0)
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"has_answer": found}}
