"""One plan per iteration (pipeline/schedule.py) and the policy object as the one place that
knows what a policy is: tools with train.max_staleness sample from the behaviour policy (their
chat template and stop tokens come from it, not from a policy that does not exist yet), both
iterate loops run the same code, and no module outside the policy object, the LoRA module and
the config tree branches on `train.lora`."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import REPO, grpo, write_config
from test_agents import tiny2k, tool_rows, tools_file  # noqa: F401 (fixtures)


def test_plan_names_the_behaviour_policy_and_the_passes(assets):
    from conftest import base_config
    from pipeline import config as config_mod
    from pipeline.schedule import iteration_plan

    cfg = config_mod.resolve(base_config(assets, train={"mini_batch_size": 8, "lr": 1e-4, "precision": "fp32", "max_staleness": 2}))
    plans = [iteration_plan(cfg, k) for k in range(4)]
    assert [p.behaviour for p in plans] == [0, 0, 0, 1]  # b(k) = max(0, k - 2)
    assert [p.staleness for p in plans] == [0, 1, 2, 2]
    on_policy = config_mod.resolve(base_config(assets))
    assert iteration_plan(on_policy, 3).behaviour == 3 and iteration_plan(on_policy, 3).staleness is None


def test_tools_with_staleness_plan_iteration_1_before_policy_1_exists(make_run, tiny2k, tools_file, tmp_path):  # noqa: F811
    """Issue 32 (1): the agents were loaded from policy k's directory, which the overlapped
    sampler asks for before update k-1 wrote it: `RUN/policy/iter-0001: policy missing`."""
    from pipeline.rollout import RolloutInputs
    from pipeline.run.run import Run

    path = make_run("stale-tools", model=tiny2k, data={"train": tool_rows(tmp_path / "tools.jsonl"), "system_prompt": None},
                    rollout={"tools": [f"{tools_file}:multiply"], "max_new_tokens": 12, "max_episode_tokens": 400},
                    rewards=[{"fn": "correct"}], train={"mini_batch_size": 8, "lr": 1e-4, "precision": "fp32", "max_staleness": 1})
    run = Run(path)
    assert not (Path(path) / "policy" / "iter-0001").exists()
    plan = RolloutInputs(run, 1)  # sampled from policy 0
    assert plan.policy_iter == 0 and plan.episodes is not None and "multiply" in plan.episodes.a.tools


ALLOWED = {"pipeline/run/policy.py", "pipeline/run/lora.py", "pipeline/config/tree.py", "pipeline/config/rules.py",
           "pipeline/config/errors.py",
           "pipeline/config/rollout.py"}
"""The policy object, the LoRA module and the config tree: the only modules that may ask whether a run trains LoRA."""


def test_no_module_outside_the_policy_object_branches_on_lora():
    offenders = []
    for path in sorted([*REPO.glob("pipeline/**/*.py"), *REPO.glob("stages/**/*.py")]):
        rel = path.relative_to(REPO).as_posix()
        if rel in ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "lora":
                offenders.append(f"{rel}:{node.lineno} reads .lora")
            elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "is_adapter":
                offenders.append(f"{rel}:{node.lineno} calls is_adapter")
    assert not offenders, "ask the policy object (pipeline/run/policy.py) instead:\n  " + "\n  ".join(offenders)


@pytest.mark.slow
def test_tool_episodes_with_staleness_run_to_the_end_and_audit_clean(assets, tiny2k, tools_file, tmp_path):  # noqa: F811
    """`grpo iterate` with a tool and train.max_staleness 1 (the sampler in its own process, one
    rollout ahead, loading its agents from the behaviour policy) runs to the end and audits clean.
    That a stale schedule writes the same bytes on a rerun is test_staleness's (one run there, with
    the separate stage commands and SIGKILLs against it); one run here keeps the suite's time."""
    from conftest import base_config

    cfg = base_config(assets, model=tiny2k, data={"train": tool_rows(tmp_path / "tools.jsonl"), "system_prompt": None},
                      rollout={"tools": [f"{tools_file}:multiply"], "max_new_tokens": 12, "max_episode_tokens": 200,
                               "num_generations": 4, "prompts_per_iter": 2, "groups_per_part": 1, "max_turns": 2},
                      rewards=[{"fn": "correct"}], train={"mini_batch_size": 8, "lr": 1e-4, "precision": "fp32", "max_staleness": 1})
    run = tmp_path / "run"
    grpo("init", str(run), "--config", str(write_config(tmp_path / "config.yaml", cfg)))
    grpo("iterate", str(run), "--iters", "2", timeout=1800)
    m = json.loads((run / "iter-0001" / "rollout" / "MANIFEST.json").read_text())
    assert m["staleness"] == 1 and m["inputs"]["policy"]["path"] == "policy/iter-0000"
    episodes = [json.loads(e) for p in sorted((run / "iter-0001/rollout").glob("part-*.parquet"))
                for e in pq.read_table(p, columns=["episode"]).column("episode").to_pylist()]
    assert len(episodes) == 8 and all(e["tools"] == ["multiply"] and e["ending"] for e in episodes)
    audit = grpo("audit", str(run), check=False)
    assert audit.returncode == 0, audit.stdout + audit.stderr


def test_dr_grpo_normalises_episodes_by_their_whole_budget(assets):
    """Issue 32 (8): TRL's max_completion_length bounds a whole multi-turn completion; Dr. GRPO's
    fixed normaliser is that budget on episodes, max_new_tokens on single completions."""
    from conftest import base_config
    from pipeline import config as config_mod

    single = config_mod.resolve(base_config(assets, loss={"type": "dr_grpo"}))
    assert single.rollout.completion_budget() == single.rollout.max_new_tokens == 24
    episodes = config_mod.resolve(base_config(assets, loss={"type": "dr_grpo"},
                                              rollout={"tools": ["python"], "max_new_tokens": 24, "max_episode_tokens": 300}))
    assert episodes.rollout.completion_budget() == 300
    turns = config_mod.resolve(base_config(assets, rollout={"tools": ["python"], "max_new_tokens": 24, "max_turns": 3}))
    assert turns.rollout.completion_budget() == 72  # no episode budget given: max_turns x max_new_tokens
