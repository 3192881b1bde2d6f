"""A reward written for verl (`custom_reward_function.path: verl_reward.py`, `name: compute_score`),
run here unchanged with `contract: verl` (docs/rewards.md#verl)."""

import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    numbers = re.findall(r"-?\d+(?:\.\d+)?", solution_str.replace(",", ""))
    gold = str(ground_truth).split("####")[-1].strip().replace(",", "")
    acc = bool(numbers) and numbers[-1] == gold
    return {"score": 1.0 if acc else 0.0, "acc": acc}
