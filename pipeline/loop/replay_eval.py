"""`grpo eval NEW --replay SRC [--iter K] --set rewards=[...]`: SRC's eval of policy K scored anew.

    SRC/policy/iter-K  --copy-->  NEW/policy/iter-0000       (as `grpo replay`: pipeline/loop/replay.py)
    SRC/iter-K/eval    --------->  NEW/iter-0000/eval        (the same completions, new reward columns,
                                                              `correct` and figures)

The completions are SRC's, never sampled again: NEW's eval parts hold them with the rewards of NEW's
config (another reward function, another accuracy reward, other pass_k), and its manifest's
`inputs.replayed_from` names SRC's eval manifest. A reward sees SRC's completion text; its
`completion_ids` are that text tokenized again (an eval part keeps the text, not the sampled ids).
NEW must evaluate the same prompts in the same parts (data.eval, eval.max_prompts,
eval.prompts_per_part) with as many samples; episodes cannot be replayed (their turns ran tools).
"""

from __future__ import annotations

from pipeline.errors import GRPOError
from pipeline.store import RunStore, stage_rel
from pipeline.run.run import Run


def replay_eval(src_uri: str, k: int | None, new_uri: str, sets: list[str] | None = None) -> tuple[Run, int]:
    """Create (or resume) NEW, its eval of policy 0 being SRC's eval of policy K re-scored; (NEW, K)."""
    from pipeline.eval.compare import record
    from pipeline.eval.run import run_eval
    from pipeline.loop.replay import merged_origin, replay_config
    from pipeline.run.parts import read_part
    from pipeline.run.run import init_run
    from schemas.artifacts import EVAL

    src = Run(src_uri)
    if RunStore(new_uri).display() == src.store.display():
        raise GRPOError(f"--replay {src_uri}: the replay needs a new record directory, not the source run")
    k, _ = record(src, k)
    if src.policy_pruned(k):
        raise GRPOError(f"{src.store.display()}: policy {k} was pruned (train.keep_policies); its eval cannot be replayed")
    cfg = replay_config(src, k, sets)
    if cfg.rollout.agentic:
        raise GRPOError("--replay: an eval of episodes cannot be replayed (its turns ran tools and environments)")
    if (cfg.eval.samples, cfg.eval.greedy) != (src.cfg.eval.samples, src.cfg.eval.greedy):
        raise GRPOError("--replay: eval.samples and eval.greedy are how SRC's completions were sampled; they cannot change")
    new = init_run(new_uri, cfg, merged_from=merged_origin(src, k))
    src_m = src.manifest(k, "eval")
    link = {"run": src.store.display(), "iteration": k, "manifest_sha256": src.store.manifest_hash(stage_rel(k, "eval"))}
    recorded = [read_part(src, k, "eval", EVAL, p) for p in range(len(src_m.outputs))]
    run_eval(new, 0, recorded=recorded, replayed_from=link)
    return new, k
