"""The issue's "Done when" on a real model: examples/endpoint_agent.py (the OpenAI SDK as documented,
one tool; streamed or not per episode, from the task row's `stream`) through `grpo iterate` on
SmolLM2-135M-Instruct. The mask-1 tokens are what the engine samples again from the row's prefix and
the recorded seed; a run killed mid-rollout (after its first part) and resumed writes the bytes of an
uninterrupted one. Tiny on purpose: 2 prompts x 2 samples, 2 turns, 16 new tokens, the HF engine."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import REPO, base_config, grpo, write_config
from test_resume import KILLED

AGENT = str(REPO / "examples/endpoint_agent.py")


def calc_rows(path: Path) -> str:
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} * {b}? Use the multiply tool."}], "answer": f"#### {a * b}",
             "stream": stream} for (a, b), stream in (((12, 7), True), ((9, 13), False))]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.slow
def test_smollm2_openai_sdk_agent_through_iterate_token_exact_and_resumed_identical(assets, smollm2, tmp_path):
    from pipeline.rollout import policy_engine
    from pipeline.run.run import Run

    cfg = base_config(assets, model=smollm2["gguf"], data={"train": calc_rows(tmp_path / "calc.jsonl"), "eval": None, "system_prompt": None},
                      rollout={"engine": "hf", "num_generations": 2, "prompts_per_iter": 2, "groups_per_part": 1,
                               "max_new_tokens": 16, "max_turns": 2, "max_episode_tokens": 64, "temperature": 0.8,
                               "agent": {"command": ["python", AGENT], "timeout_s": 120}},
                      rewards=[{"fn": "pipeline.agents.endpoint.result:agent_reward", "name": "agent"}],
                      train={"mini_batch_size": 4, "lr": 1e-4, "lora": {"r": 4, "alpha": 8}})
    conf = write_config(tmp_path / "cfg.yaml", cfg)
    runs = {}
    for name in ("whole", "killed"):
        runs[name] = tmp_path / name
        grpo("init", str(runs[name]), "--config", str(conf))
    # killed after the rollout's first part (of 2), then the same command again
    out = grpo("iterate", str(runs["killed"]), "--iters", "1", env={"GRPO_FAULT": "rollout:part:0"}, check=False)
    assert out.returncode == KILLED, out.stderr[-3000:]
    assert len(list((runs["killed"] / "iter-0000/rollout").glob("part-*.parquet"))) == 1
    for run in runs.values():
        grpo("iterate", str(run), "--iters", "1")
    for stage in ("rollout", "score"):
        a, b = (sorted((r / f"iter-0000/{stage}").glob("part-*.parquet")) for r in runs.values())
        assert len(a) == 2 and [p.read_bytes() for p in a] == [p.read_bytes() for p in b], stage
    got = [r for p in sorted((runs["whole"] / "iter-0000/rollout").glob("part-*.parquet")) for r in pq.read_table(p).to_pylist()]
    assert len(got) == 4
    engine = policy_engine(Run(str(runs["whole"])), 0)
    try:
        for row in got:
            rec = json.loads(row["episode"])
            turns = [q for q in rec["requests"] if q["kind"] == "turn"]
            assert rec["route"] == "endpoint" and turns and rec["turns"] == len(turns), rec
            assert all(bool(q["asked"].get("stream")) == row["stream"] for q in turns)  # per episode, from its row
            ids, at, mask = row["completion_ids"], 0, []
            for q in turns:
                delta = q.get("prompt_delta", [])
                assert ids[at:at + len(delta)] == delta
                at += len(delta)
                again = engine.generate([row["prompt_ids"] + ids[:at]], [q["seed"]], 1, max_tokens=[q["sampling"]["max_tokens"]])[0][0]
                assert list(again.token_ids) == q["completion_ids"] == ids[at:at + len(q["completion_ids"])]
                at += len(q["completion_ids"])
                mask += [0] * len(delta) + [1] * len(q["completion_ids"])
            assert at == len(ids) and row["completion_mask"] == mask  # mask 1 exactly on the engine's sampled ids
    finally:
        engine.close()
    assert (runs["whole"] / "policy/iter-0001/adapter_config.json").exists()
    assert ": ok, 1 iteration(s)" in grpo("audit", str(runs["whole"])).stdout
    shown = grpo("inspect", str(runs["whole"])).stdout  # the episodes as their requests (pipeline/report/episodes.py)
    assert "[request 1: turn" in shown and "[end: " in shown, shown
