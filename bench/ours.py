"""Worker: `grpo iterate` (pipeline.loop.iterate, warm engines) on one workload, with probes, and the
bare engines run between iterations on the same warm engines.

    python -m bench.ours WORKLOAD_JSON OUT_JSON

Iteration 0 starts the engines and is reported as the cold start; the bare baselines run after
every iteration, their first round being their own warm-up.
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import shutil
import sys
import time
from pathlib import Path

from bench import bare
from bench.probes import Probes, by_phase, diff, install_import_probe, install_product_probes, loadavg, machine_info
from bench.workloads import WORK, load_workload, resolved_config


def run_dir(name: str) -> Path:
    return WORK / "runs" / name


def main(workload_json: str, out: str) -> None:
    from pipeline.loop import iterate as iterate_mod
    from pipeline.models.engines import cpu_env
    from pipeline.run.run import init_run

    cpu_env()
    w = load_workload(workload_json)
    path = run_dir(w.name)
    shutil.rmtree(path, ignore_errors=True)
    cfg = resolved_config(w)
    run = init_run(str(path), cfg)

    probes = Probes()
    install_import_probe(probes)
    install_product_probes(probes)
    probes.rss.start()

    held: dict = {}

    class Warm(iterate_mod.WarmEngines):  # the same engines; keeps a handle for the baselines
        def __init__(self, r):
            super().__init__(r)
            held["warm"] = self

    iterate_mod.WarmEngines = Warm
    rows: list[dict] = []
    mark = {"snap": probes.snapshot(), "cpu": probes.snapshot(cpu=True), "phase_cpu": dict(probes.phase_cpu), "gc": dict(probes.gc_seconds)}
    bare_ds: dict = {}

    profiler = cProfile.Profile()

    def on_iteration(row: dict) -> None:
        k = row["iteration"]
        if k == w.iters:  # the extra, profiled iteration: not timed, no baselines
            profiler.disable()
            rows.append({"iteration": k, "profiled": True, "seconds": row["seconds"], "reward/mean": row.get("reward/mean")})
            return
        probes.set_phase("bare")
        row["categories"] = by_phase(diff(probes.snapshot(), mark["snap"]))
        row["cpu_categories"] = by_phase(diff(probes.snapshot(cpu=True), mark["cpu"]))
        row["cpu"] = diff(dict(probes.phase_cpu), mark["phase_cpu"])  # CPU seconds per stage
        row["gc"] = by_phase(diff(dict(probes.gc_seconds), mark["gc"]))  # GC pauses per stage and generation
        roll = run.manifest(k, "rollout")
        row["tokens"] = roll.stats["tokens"]
        row["completions"] = roll.rows
        row["loadavg"] = loadavg()
        # the bare engines, same work, on the warm engines (vLLM and the logprob model hold policy k)
        warm = held["warm"]
        data = bare.iteration_data(run, k)
        gc_before = sum(probes.gc_seconds.values())
        row["bare"] = {}
        if cfg.rollout.engine == "vllm":  # the HF engine's bare baseline is TRL's own `generate` (bench.trl_run)
            warm.engine.wake()  # iterate gave its KV cache and policy k's weights back after the rollout
            row["bare"]["rollout"] = bare.vllm_generate(warm.engine.llm, cfg, k, data)
            warm.engine.sleep()  # as iterate left it: our next rollout pays the wake, as it would without this baseline
        old_model = warm.logprobs.old
        if old_model is None:  # the run made no old pass (the update's forward gave them): policy k for the baseline
            # a LoRA policy k > 0 is an adapter: the base with it, as the logprobs stage would load it
            old_model = run.policy.load_old(run, k)
        row["bare"]["logprobs"] = bare.hf_forward(old_model, cfg, data)
        row["bare"]["logprobs"]["ours_made_no_old_pass"] = data["old_from_update"]
        del old_model
        if "engine" not in bare_ds:
            bare_ds["engine"] = bare.BareDeepSpeed(cfg, run.policy_dir(0), micro_batch=w.trl_micro_batch)
        row["bare"]["update"] = bare_ds["engine"].step_loop(k, data)
        row["bare_gc_s"] = sum(probes.gc_seconds.values()) - gc_before
        rows.append(row)
        print(f"[{w.name}] iteration {k}: {row['seconds']:.1f}s "
              + " ".join(f"{s}={v:.2f}" for s, v in row["timings"].items())
              + " | bare " + " ".join(f"{s}={v['seconds']:.2f}" for s, v in row["bare"].items()), flush=True)
        probes.set_phase("final")
        mark.update(snap=probes.snapshot(), cpu=probes.snapshot(cpu=True), phase_cpu=dict(probes.phase_cpu), gc=dict(probes.gc_seconds))
        if w.profile and k == w.iters - 1:
            profiler.enable()

    info = machine_info()
    t0 = time.perf_counter()
    iterate_mod.iterate(run, w.iters + (1 if w.profile else 0), on_iteration=on_iteration)
    wall = time.perf_counter() - t0
    final = by_phase(diff(probes.snapshot(), mark["snap"]))
    probes.rss.stop()
    result = {
        "workload": w.as_dict(),
        "machine_start": info,
        "loadavg_end": loadavg(),
        "wall_s": wall,
        "iterations": rows,
        "final": final,
        "probes": probes.report(),
        "config": cfg.model_dump(mode="json"),
        "profile": profile_text(profiler) if w.profile else None,
    }
    if w.profile:  # the raw stats, for digging further: python -m pstats bench/work/results/NAME.prof
        profiler.dump_stats(str(Path(out).with_name(f"{w.name}.prof")))
    Path(out).write_text(json.dumps(result, indent=1, default=str))


def profile_text(profiler: cProfile.Profile, n: int = 25) -> dict:
    """The profiled iteration's top functions, by own time and by cumulative time."""
    out = {}
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).strip_dirs().sort_stats(key).print_stats(n)
        text = buf.getvalue()
        out[key] = text[text.find("   ncalls"):].rstrip()
    return out


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
