"""`grpo init RUN --config FILE [--set k=v ...]`: create a run.

Writes RUN/config.yaml (the resolved config) and RUN/policy/iter-0000 (the initial model).
Refuses to overwrite an existing run with a different config.
"""

from stages.options import ConfigOpt, RunArg, SetOpt


def init(run: RunArg, config: ConfigOpt, set: SetOpt = None) -> None:
    """Create a run directory from a config file."""
    from pipeline import config as config_mod
    from pipeline import preflight
    from pipeline.store.run import init_run

    cfg = config_mod.load(config, set)
    for note in preflight.check(cfg):  # reward functions, dataset header, tools: before anything is written
        print(f"note: {note}")
    r = init_run(run, cfg)
    print(f"run {r.store.display()} ready (config {r.cfg_hash[:12]}); next: grpo iterate {run} --iters N")
