"""results.json -> results.md: the targets with their measured ratios, then the tables behind them.

Definitions (also printed in the markdown):
- An iteration's seconds and each stage's seconds come from `grpo iterate`'s own clock; the
  first iteration (engine start) is reported separately as the cold start and not averaged.
- tokens/s counts completion tokens processed: rollout and logprobs once, update once per epoch.
- Ratios are ours / bare (or ours / TRL) on sums over the measured iterations.
- Categories are exclusive wall times of probed product functions; "other" is the rest of the
  stage (Python glue between them).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from bench.probes import ARTIFACT
from bench.workloads import ROOT

STAGES = ("rollout", "score", "logprobs", "update")
BARE = {"rollout": "vLLM `generate`", "logprobs": "HF forward", "update": "DeepSpeed step loop"}
ENGINE = {"rollout": "generate", "logprobs": "forward", "update": "train"}
TARGETS = {"rollout": 1 / 0.9, "logprobs": 1.3, "update": 1.1}
"""Seconds ours / bare: rollout at >= 0.9x bare vLLM's throughput, update <= 1.1x a bare loop (issue 17);
logprobs keeps the earlier round's 1.3x."""
TRL_TARGET, ARTIFACT_TARGET = 0.5, 0.05
HF_TRL_TARGET = 1.0
"""grpo's HF engine (`rollout.engine: hf`) against TRL, both on transformers' `generate`: the iteration at
most 1.0 x TRL's and the rollout at most TRL's generation of the same rows (issue 61)."""
COMMANDS_TARGET = 1.5
"""The four separate commands, cold, per iteration <= 1.5x warm `grpo iterate` (real-full)."""
SCORE_COLD_TARGET_S = 5.0
RSS_TARGET_GB, LORA_RSS_TARGET = 6.0, 0.6
"""Peak RSS of warm `iterate` on real-full <= 6 GB; real-lora <= 0.6x real-full."""
BENCH_TARGET_MIN = 30.0
LORA_RSS_LEVER = ("measured 2026-11-24 in one process each on the bench's runs: `train.update_token_budget: 512` instead of "
                  "the default 1024 gives real-lora 2547 MB against real-full 4662 MB, 0.55 x, at 13-20 % more update time")
"""What the real-lora RSS ratio would take: a lever measured apart (the bench runs the defaults)."""


def trl_target(s: dict) -> float:
    return HF_TRL_TARGET if s["workload"].get("engine") == "hf" else TRL_TARGET


def measured(rows: list[dict]) -> list[dict]:
    """Iterations after the first (the first starts the engines); all of them if only one."""
    return rows[1:] or rows


def mean(xs) -> float:
    xs = list(xs)
    return statistics.fmean(xs) if xs else float("nan")


def cat_means(rows: list[dict], phase: str) -> dict[str, float]:
    cats: dict[str, float] = {}
    for r in rows:
        for c, s in r["categories"].get(phase, {}).items():
            cats[c] = cats.get(c, 0.0) + s / len(rows)
    return cats


def trl_cycle_s(trl: dict) -> float:
    """Mean seconds per measured TRL cycle (the first cycle is warm-up)."""
    return mean(c["seconds"] for c in measured(trl["cycles"]))


def summarize(entry: dict) -> dict:
    """The numbers the tables show, for one workload."""
    it = entry["iterate"]
    timed = [r for r in it["iterations"] if not r.get("profiled")]
    rows = measured(timed)
    w = entry["workload"]
    s: dict = {"workload": w, "n": len(rows), "iter_s": mean(r["seconds"] for r in rows)}
    s["iter_cpu_s"] = mean(sum(r["cpu"].get(p, 0.0) for p in STAGES + ("summary",)) for r in rows)
    s["tokens"] = mean(r["tokens"] for r in rows)
    s["cold_s"] = timed[0]["seconds"]
    s["cold_engine_start_s"] = sum(c.get("engine_start", 0.0) for c in timed[0]["categories"].values())
    s["cold_imports_s"] = sum(c.get("imports", 0.0) for c in timed[0]["categories"].values())
    s["stages"] = {}
    for st in STAGES + ("summary",):
        # summary: iteration_summary, the rest of the iteration after the four stages
        secs = mean(r["timings"][st] if st != "summary" else r["seconds"] - sum(r["timings"].values()) for r in rows)
        cats = cat_means(rows, st)
        row = {"seconds": secs, "categories": cats, "other": max(0.0, secs - sum(cats.values())),
               "peak_rss_mb": it["probes"]["rss_peak_mb"].get(st),
               "gc_s": mean(sum(r.get("gc", {}).get(st, {}).values()) for r in rows)}
        toks = s["tokens"] * (w["epochs"] if st == "update" else 1)
        row["tokens_per_s"] = toks / secs if secs and st in ("rollout", "logprobs", "update") else None
        if st in BARE and all(st in r["bare"] for r in rows):  # no bare rollout beside the HF engine: TRL's is its baseline
            ours_sum = sum(r["timings"][st] for r in rows)
            bare_sum = sum(r["bare"][st]["seconds"] for r in rows)
            eng_sum = sum(r["categories"].get(st, {}).get(ENGINE[st], 0.0) for r in rows)
            row["bare_s"] = bare_sum / len(rows)
            row["bare_tokens_per_s"] = toks / row["bare_s"] if row["bare_s"] else None
            row["ratio"] = ours_sum / bare_sum
            row["engine_s"] = eng_sum / len(rows)
            row["engine_ratio"] = eng_sum / bare_sum
            row["cpu_ratio"] = sum(r["cpu"].get(st, 0.0) for r in rows) / sum(r["bare"][st]["cpu_s"] for r in rows)
        s["stages"][st] = row
    s["no_old_pass"] = all(r["bare"]["logprobs"].get("ours_made_no_old_pass", False) for r in timed)
    s["bare_checks"] = {
        "same_tokens": all(r["bare"]["rollout"]["same_tokens"] for r in timed if "rollout" in r["bare"]),
        "logprob_max_abs_diff": max(r["bare"]["logprobs"]["max_abs_diff_vs_ours"] for r in timed),
    }
    art = {c: mean(sum(r["categories"].get(p, {}).get(c, 0.0) for p in STAGES + ("summary",)) for r in rows) for c in ARTIFACT + ("code_version", "checkpoint")}
    s["artifact"] = art
    s["artifact_s"] = sum(art[c] for c in ARTIFACT + ("code_version",))
    s["artifact_frac"] = s["artifact_s"] / s["iter_s"]
    s["checkpoint_frac"] = art["checkpoint"] / s["iter_s"]
    s["rewards"] = [r.get("reward/mean") for r in it["iterations"]]
    s["loadavg"] = [r["loadavg"][0] for r in timed]
    s["profile"] = it.get("profile")
    s["peak_rss_mb"] = it["probes"]["process_peak_rss_mb"]  # the worker: ours and the bare engines' models
    if entry.get("iterate_process"):  # a plain `grpo iterate --more 1` process: what a user's run needs
        s["iterate_rss_mb"] = entry["iterate_process"]["peak_rss_mb"]
    if "trl" in entry:
        t = entry["trl"]
        cyc = measured(t["cycles"])
        s["trl"] = {
            "cycle_s": mean(c["seconds"] for c in cyc),
            "cycle_cpu_s": mean(c["cpu_s"] for c in cyc),
            "generate_s": mean(c["generate_s"] for c in cyc),
            "generate_cpu_s": mean(c.get("generate_cpu_s", float("nan")) for c in cyc),
            "tokens_per_s": sum(c["tokens"] for c in cyc) / sum(c["seconds"] for c in cyc),
            "rewards": [c["reward/mean"] for c in t["cycles"]],
            "setup_s": t["setup_s"],
            "peak_rss_mb": t["peak_rss_mb"],
            "steps_per_cycle": t["steps_per_cycle"],
            "loadavg": [c["loadavg"][0] for c in t["cycles"]],
            "precision": t.get("precision", "fp32"),
            "by_precision": {p: trl_cycle_s(r) for p, r in entry.get("trl_runs", {}).items()},
        }
        s["trl"]["ratio"] = s["iter_s"] / s["trl"]["cycle_s"]
        s["trl"]["cpu_ratio"] = s["iter_cpu_s"] / s["trl"]["cycle_cpu_s"]
    s["ours_tokens_per_s"] = s["tokens"] / s["iter_s"]
    if entry.get("commands"):
        s["commands"] = summarize_commands(entry["commands"], s["iter_s"])
    return s


def summarize_commands(iterations: list[dict], warm_iter_s: float) -> dict:
    per_stage = {}
    for st in STAGES:
        cs = [c for it in iterations for c in it["stages"] if c["stage"] == st]
        cats: dict[str, float] = {}
        for c in cs:
            for phase in c["categories"].values():
                for k, v in phase.items():
                    cats[k] = cats.get(k, 0.0) + v / len(cs)
        wall = mean(c["wall_s"] for c in cs)
        row = {
            "wall_s": wall,
            "startup_s": mean(c["startup_s"] for c in cs),
            "exit_s": mean(c["exit_s"] for c in cs),
            "import_total_s": mean(c["import_total_s"] for c in cs),
            "imports_s": cats.get("imports", 0.0),
            "engine_start_s": cats.get("engine_start", 0.0),
            "mlflow_s": cats.get("mlflow", 0.0) + cats.get("diagnostics", 0.0),
            "compute_s": sum(cats.get(k, 0.0) for k in ("generate", "forward", "train", "rewards")),
            "artifact_s": sum(cats.get(k, 0.0) for k in ARTIFACT + ("code_version", "checkpoint") if k not in ("mlflow", "diagnostics")),
            "peak_rss_mb": max(c["peak_rss_mb"] for c in cs),
            "top_imports": {k: mean(c.get("top_imports", {}).get(k, 0.0) for c in cs) for k in cs[0].get("top_imports", {})},
        }
        row["other_s"] = wall - sum(row[k] for k in ("startup_s", "exit_s", "imports_s", "engine_start_s", "mlflow_s", "compute_s", "artifact_s"))
        per_stage[st] = row
    total = mean(it["wall_s"] for it in iterations)
    fixed = {k: sum(p[k] for p in per_stage.values()) for k in ("startup_s", "imports_s", "engine_start_s", "exit_s", "mlflow_s", "other_s")}
    return {"stages": per_stage, "iteration_s": total, "extra_s": total - warm_iter_s, "fixed": fixed}


# ------------------------------------------------------------------------------------ markdown
def _f(x, spec=".2f", none="-") -> str:
    return none if x is None or x != x else format(x, spec)


def _ok(ratio: float, target: float, cpu: float | None = None) -> str:
    wall = "met" if ratio <= target else "**missed**"
    if cpu is None or (ratio <= target) == (cpu <= target):
        return wall
    return f"{wall} (by CPU: {'met' if cpu <= target else '**missed**'})"


def _top(cats: dict[str, float], other: float, n: int = 4) -> str:
    items = sorted({**cats, "other": other}.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{k} {v:.2f}" for k, v in items if v >= 0.005)


def bench_minutes(results: dict) -> float:
    """What one `make bench` of the table's workloads takes: the run's own minutes, or, for a
    table merged from several runs, the wall time of each workload's processes (ours with the
    bare engines, the separate commands, the plain `iterate`, TRL at each precision) and the cold
    timings of the engine-free commands (their medians times the runs)."""
    if not results.get("merged"):
        return results["total_s"] / 60
    secs = 0.0
    for e in results["workloads"].values():
        secs += e["iterate"].get("process_wall_s", 0.0) + sum(r.get("process_wall_s", 0.0) for r in e.get("trl_runs", {}).values())
        secs += sum(it.get("wall_s", 0.0) for it in e.get("commands") or [])
        secs += (e.get("iterate_process") or {}).get("wall_s", 0.0)
    cold = (results.get("cold") or {}).get("commands", {})
    secs += sum(r["median_s"] * r["runs"] for r in cold.values())
    return secs / 60


def _engine_s(s: dict) -> float:
    """Seconds per iteration inside the engines: generate, the logprob forward, the trainer."""
    return sum(s["stages"][st].get("engine_s") or 0.0 for st in BARE)


def _why_trl(name: str, s: dict) -> str:
    t = s["trl"]
    eng = _engine_s(s)
    cut = s["iter_s"] - TRL_TARGET * t["cycle_s"]
    return (f"{name}, against TRL ({t['ratio']:.2f} x): of our {s['iter_s']:.2f} s per iteration {eng:.2f} s are the engine calls "
            f"({eng / t['cycle_s']:.2f} x TRL's {t['cycle_s']:.2f} s cycle by themselves) and {s['iter_s'] - eng:.2f} s the fixed "
            f"bookkeeping around them (artifacts {s['artifact_s']:.2f} s, checkpoints {s['artifact']['checkpoint']:.2f} s, the rest "
            f"glue). {TRL_TARGET} x needs {cut:.2f} s less per iteration. What would reach it: fewer fixed costs per iteration "
            "(MLflow logging and manifests batched over iterations, a checkpoint every few iterations, which weakens resume), or "
            "longer iterations, where the engines' speed shows (the real-* workloads).")


def _why_stage(name: str, st: str, r: dict, sums: dict, lora: bool = False) -> str:
    rest = r["seconds"] - r["engine_s"]
    head = f"{name}, {st} ({r['ratio']:.2f} x bare): "
    if r["engine_ratio"] > TARGETS[st]:
        longer = [o["stages"][st]["engine_ratio"] for o in sums.values() if (o["stages"][st].get("engine_s") or 0.0) >= 1.0]
        seen = f" (the workloads whose engine call takes a second or more: {min(longer):.2f}-{max(longer):.2f} x bare)" if longer else ""
        return (head + f"the engine call itself is {r['engine_ratio']:.2f} x bare ({r['engine_s']:.2f} s against {r['bare_s']:.2f} s, "
                f"same engine and prompts; ours is the first call after the new weights' reload, bare the next one), and {rest:.2f} s "
                f"are around it. What would reach it: longer engine calls, where that first-call cost disappears{seen}.")
    allowed = TARGETS[st] * r["bare_s"] - r["engine_s"]
    top = _top({k: v for k, v in r["categories"].items() if k != ENGINE[st]}, r["other"], 4)
    merged = lora and r["categories"].get("engine_reload", 0.0) > 0.3 * rest
    woke = r["categories"].get("engine_wake", 0.0) > 0.2 * rest
    levers = []
    if woke:
        levers.append("an engine kept awake between rollouts skips the wake (the KV cache re-zeroed and, where no new "
                      "weights came, the same weights reloaded), at the price of the memory it gives back while the update runs")
    if merged:
        levers.append("the merged adapter's weights reach vLLM through a safetensors file; handing the tensors over in memory, "
                      "`reload_weights(weights_iterator=...)`, would skip the write and the read")
    return (head + f"the engine call alone is {r['engine_ratio']:.2f} x bare; the other {rest:.2f} s are {top}. What would reach it: "
            f"{allowed:.2f} s or less around the engine call" + (f" ({'; '.join(levers)})" if levers else "") + ".")


def _why_commands(name: str, s: dict) -> str:
    c, f = s["commands"], s["commands"]["fixed"]
    cut = c["iteration_s"] - COMMANDS_TARGET * s["iter_s"]
    return (f"{name}, four separate commands ({c['iteration_s']:.1f} s against {s['iter_s']:.1f} s warm): each process pays its "
            f"start-up, over the four imports {f['imports_s']:.1f} s, engine starts {f['engine_start_s']:.1f} s, interpreter start "
            f"and exit {f['startup_s'] + f['exit_s']:.1f} s, unprobed glue {f['other_s']:.1f} s. {COMMANDS_TARGET} x needs "
            f"{cut:.1f} s less. What would reach it: a resident worker the stage commands hand their work to (what `grpo iterate` "
            "is), or iterations long enough that the same start-up is under half of one (about twice the prompts per iteration).")


def _why_lora_rss(name: str, s: dict, full: dict) -> str:
    want = LORA_RSS_TARGET * full["iterate_rss_mb"]
    return (f"{name}, peak RSS ({s['iterate_rss_mb']:.0f} MB against real-full's {full['iterate_rss_mb']:.0f} MB): LoRA drops the "
            f"fp32 master weights, their gradients and AdamW's state ({full['iterate_rss_mb'] - s['iterate_rss_mb']:.0f} MB here), "
            "but not what both hold: the imports and the idle engine's runtime, and a 1024-token update piece's activations and "
            f"their transients. {LORA_RSS_TARGET} x needs {s['iterate_rss_mb'] - want:.0f} MB less, which only a smaller common part "
            f"gives. What would reach it: {LORA_RSS_LEVER}.")


def _why_bench(results: dict, mins: float) -> str:
    trl = sum(r.get("process_wall_s", 0.0) for e in results["workloads"].values() for r in e.get("trl_runs", {}).values()) / 60
    slower = [max(e["trl_runs"].values(), key=trl_cycle_s) for e in results["workloads"].values() if len(e.get("trl_runs", {})) > 1]
    slower_min = sum(r.get("process_wall_s", 0.0) for r in slower) / 60
    measured_min = sum(c["seconds"] for r in slower for c in measured(r["cycles"])) / 60
    return (f"`make bench` ({mins:.1f} min): TRL's runs take {trl:.1f} min of it (each workload at bf16 off and on, a warm-up "
            f"cycle and a measured one each, as the issue asks), {slower_min:.1f} min of them at the slower precision. What would "
            f"reach {BENCH_TARGET_MIN:.0f} min: stopping the slower precision's run once its warm-up cycle is past the faster one's "
            f"measured cycle saves at least its measured cycles, {measured_min:.1f} min; the rest needs fewer baselines or "
            "workloads, or a machine with more than 2 cores.")


def render(results: dict, sides: list[str] = ()) -> str:
    """The main bench's page from bench/results.json, with `sides` (the side benches' sections) before its definitions."""
    m = results["machine"]
    sums = {name: summarize(e) for name, e in results["workloads"].items()}
    loads = [x for s in sums.values() for x in s["loadavg"] + s.get("trl", {}).get("loadavg", [])]
    out = ["# grpo benchmark results", ""]
    kind = "quick run (`python -m bench --quick`)" if results.get("quick") else "full run (`make bench`)"
    out.append(f"{kind}, started {results['started']}, {results.get('total_s', 0) / 60:.1f} min in all "
               f"(assets {results.get('assets_s', 0):.0f} s), code {results.get('code_version', 'not recorded')}. "
               "Generated by `bench/report.py`; do not edit by hand.")
    for mg in results.get("merged", []):
        names = [n for n, e in results["workloads"].items() if e.get("from_run", {}).get("file") == mg["file"]]
        out.append(f"Merged from an earlier run on this machine ({mg['file']}, started {mg['started']}, "
                   f"{(mg.get('total_s') or 0) / 60:.1f} min, code {mg.get('code_version') or 'not recorded'}): {', '.join(names)}.")
    out.append("")
    out += ["## Machine", ""]
    v = m["versions"]
    out.append(f"- {m['cores']} cores ({m['cpu']}; {', '.join(m['isa'])}), {m['memory_gib']} GiB, Python {m['python']}")
    out.append("- " + ", ".join(f"{k} {val}" for k, val in v.items() if val))
    thr = results.get("threads_setting")
    out.append(f"- threads: OMP_NUM_THREADS={thr if thr else 'unset (torch default: one per core)'}")
    hi = max(loads + [m["loadavg"][0]]) if loads else m["loadavg"][0]
    out.append(f"- load average (1 min): {m['loadavg'][0]:.2f} at start, {min(loads + [m['loadavg'][0]]):.2f}-{hi:.2f} during the run, "
               f"{results.get('loadavg_end', [float('nan')])[0]:.2f} at the end")
    if hi > m["cores"]:
        out.append(f"- **The machine was shared and loaded** (load up to {hi:.1f} on {m['cores']} cores): absolute times are inflated "
                   "and noisy. Ours and the bare engines alternate in one process, so those ratios see the same load; "
                   "the TRL ratio compares two processes run minutes apart and is the least reliable.")
    out.append("")

    out += ["## Targets", "", "| workload | target | measured | |", "|---|---|---|---|"]
    notes: list[str] = []  # each missed target: the measured reason, and what would reach it
    for name, s in sums.items():
        if "trl" in s:
            t = s["trl"]
            if t["ratio"] > trl_target(s):
                notes.append(_why_trl(name, s))
            which = f"TRL {t['precision']}" + (" (the faster of " + ", ".join(f"{p} {v:.1f} s" for p, v in t["by_precision"].items()) + ")"
                                                if len(t["by_precision"]) > 1 else "")
            out.append(f"| {name} | `grpo iterate` s/iteration <= {trl_target(s)} x TRL's for the same work ({which}) | {t['ratio']:.2f} x "
                       f"({s['iter_s']:.1f} s vs {t['cycle_s']:.1f} s; CPU {t['cpu_ratio']:.2f} x) | {_ok(t['ratio'], trl_target(s), t['cpu_ratio'])} |")
            if s["workload"].get("engine") == "hf":
                r = s["stages"]["rollout"]
                ratio = r["seconds"] / t["generate_s"]
                out.append(f"| {name} | rollout (HF engine) <= TRL's generation of the same rows | {ratio:.2f} x ({r['seconds']:.1f} s vs "
                           f"{t['generate_s']:.1f} s) | {_ok(ratio, 1.0)} |")
        for st in BARE:
            r = s["stages"][st]
            if "bare_s" not in r:
                continue
            if st == "logprobs" and s.get("no_old_pass"):
                out.append(f"| {name} | logprobs: no old pass (one optimizer step per epoch: the update's first-epoch forward, detached, gives the old logprobs) | "
                           f"{r['seconds']:.2f} s (the parts without that pass) vs {r['bare_s']:.2f} s for a bare HF forward | met |")
                continue
            if r["ratio"] > TARGETS[st]:
                notes.append(_why_stage(name, st, r, sums, lora=bool(s["workload"].get("lora"))))
            out.append(f"| {name} | {st} <= {TARGETS[st]:.2f} x bare {BARE[st]}{' (throughput >= 0.9 x)' if st == 'rollout' else ''} | {r['ratio']:.2f} x ({r['seconds']:.2f} s vs {r['bare_s']:.2f} s; "
                       f"CPU {r['cpu_ratio']:.2f} x; engine call alone {r['engine_ratio']:.2f} x) | {_ok(r['ratio'], TARGETS[st], r['cpu_ratio'])} |")
        target_note = "" if name.startswith("small") else " (target is for small)"
        out.append(f"| {name} | artifact overhead <= {ARTIFACT_TARGET:.0%} of an iteration{target_note} | {s['artifact_frac']:.1%} "
                   f"({s['artifact_s']:.2f} s; + checkpoints {s['checkpoint_frac']:.1%}) | "
                   f"{_ok(s['artifact_frac'], ARTIFACT_TARGET) if name.startswith('small') else '-'} |")
        if "commands" in s:
            c = s["commands"]
            ratio = c["iteration_s"] / s["iter_s"]
            if name == "real-full" and ratio > COMMANDS_TARGET:
                notes.append(_why_commands(name, s))
            out.append(f"| {name} | four separate commands, cold, per iteration <= {COMMANDS_TARGET} x warm `iterate` | {ratio:.2f} x "
                       f"({c['iteration_s']:.1f} s vs {s['iter_s']:.1f} s warm: +{c['extra_s']:.1f} s) | "
                       f"{_ok(ratio, COMMANDS_TARGET) if name == 'real-full' else '- (target is for real-full)'} |")
        gb = s.get("iterate_rss_mb", 0) * 2**20 / 1e9
        if name == "real-full" and gb:
            out.append(f"| {name} | peak RSS of `grpo iterate` <= {RSS_TARGET_GB:.0f} GB | {gb:.2f} GB | {_ok(gb, RSS_TARGET_GB)} |")
        if name.startswith("real-lora") and gb and sums.get("real-full", {}).get("iterate_rss_mb"):
            rel = s["iterate_rss_mb"] / sums["real-full"]["iterate_rss_mb"]
            if rel > LORA_RSS_TARGET:
                notes.append(_why_lora_rss(name, s, sums["real-full"]))
            out.append(f"| {name} | peak RSS of `grpo iterate` <= {LORA_RSS_TARGET} x real-full's | {rel:.3f} x ({gb:.2f} GB) | {_ok(rel, LORA_RSS_TARGET)} |")
    cold = results.get("cold")
    if cold:
        for cmd, r in cold["commands"].items():
            eng = ", ".join(r["engines_imported"]) or "neither"
            ok = "met" if not r["engines_imported"] else "**missed**"
            out.append(f"| cold `grpo {cmd}` | imports neither vLLM nor DeepSpeed | {eng} (median {r['median_s']:.2f} s of {r['runs']}) | {ok} |")
        sc = cold["commands"]["score"]
        out.append(f"| cold `grpo score` | <= {SCORE_COLD_TARGET_S:.0f} s on a demo-task run ({Path(cold['run']).name}) | median {sc['median_s']:.2f} s "
                   f"(min {sc['min_s']:.2f}, max {sc['max_s']:.2f}) | {_ok(sc['median_s'], SCORE_COLD_TARGET_S)} |")
    if results.get("total_s") and not results.get("quick"):
        mins = bench_minutes(results)
        runs = 1 + len(results.get("merged", []))
        out.append(f"| all | `make bench` <= {BENCH_TARGET_MIN:.0f} min (assets and runs; a clean clone's install comes on top) | "
                   f"{mins:.1f} min ({'the sum of every workload process in the table and the cold timings' if runs > 1 else 'this run'}"
                   f"{f', measured over {runs} runs' if runs > 1 else ''}) | {_ok(mins, BENCH_TARGET_MIN)} |")
        if mins > BENCH_TARGET_MIN:
            notes.append(_why_bench(results, mins))
    out.append("")
    if notes:
        out += ["### Missed targets: the measured reason, and what would reach it", "",
                "Computed from the tables below (per iteration, the means they show).", ""]
        out += [f"- {n}" for n in notes]
        out.append("")

    out += ["## `grpo iterate`, warm, per stage", "",
            "Mean over the iterations after the first; bare = the engine alone on the same work, in the same process, "
            "between our iterations. Categories: exclusive seconds of probed functions (see bench/probes.py).", ""]
    for name, s in sums.items():
        w = s["workload"]
        out.append(f"### {name}: {w['size']} model, {w['epochs']} epoch(s), G={w['num_generations']}, {w['prompts_per_iter']} prompts, "
                   f"<= {w['max_new_tokens']} new tokens, mini-batch {w['mini_batch_size']}"
                   + (f", {w['precision']} (ours and the bare engines)" if w.get("precision") else ""))
        out.append("")
        out.append(f"{s['iter_s']:.2f} s per iteration over {s['n']} iteration(s), {s['tokens']:.0f} completion tokens "
                   f"({s['ours_tokens_per_s']:.0f} tok/s end to end); cold first iteration {s['cold_s']:.1f} s "
                   f"(engine start {s['cold_engine_start_s']:.1f} s); peak RSS {s['peak_rss_mb']:.0f} MB with the bare engines' models beside ours"
                   + (f", {s['iterate_rss_mb']:.0f} MB as a plain `grpo iterate` process (one iteration with its engine start)." if s.get("iterate_rss_mb") else "."))
        out.append("")
        out.append("| stage | seconds | tok/s | peak RSS MB | bare s | bare tok/s | ratio (CPU) | engine call s (ratio) | where the time goes (s) | GC pauses s |")
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        for st, r in s["stages"].items():
            out.append(f"| {st} | {r['seconds']:.2f} | {_f(r['tokens_per_s'], '.0f')} | {_f(r['peak_rss_mb'], '.0f')} | "
                       f"{_f(r.get('bare_s'))} | {_f(r.get('bare_tokens_per_s'), '.0f')} | {_f(r.get('ratio'))} ({_f(r.get('cpu_ratio'))}) | "
                       f"{_f(r.get('engine_s'))} ({_f(r.get('engine_ratio'))}) | {_top(r['categories'], r['other'], 6)} | {_f(r['gc_s'])} |")
        a = s["artifact"]
        out.append("")
        out.append("Artifact overhead per iteration (s): " + ", ".join(f"{k} {a[k]:.3f}" for k in ARTIFACT + ("code_version",))
                   + f"; total {s['artifact_s']:.3f} ({s['artifact_frac']:.1%}). Checkpoints (trainer state + policy "
                   f"save + copy into the run): {a['checkpoint']:.3f} s ({s['checkpoint_frac']:.1%}).")
        chk = s["bare_checks"]
        if w.get("engine") == "hf" and "trl" in s:  # where the iteration goes, phase by phase, beside TRL's cycle
            t, st = s["trl"], s["stages"]
            inside = sum(st[x]["seconds"] for x in STAGES if x in st)
            out.append(f"Against TRL's cycle on the same rows ({t['precision']}): TRL's generation {t['generate_s']:.1f} s + its "
                       f"training {t['cycle_s'] - t['generate_s']:.1f} s = {t['cycle_s']:.1f} s; grpo's rollout "
                       f"{st['rollout']['seconds']:.1f} s + score {st['score']['seconds']:.1f} s + logprobs {st['logprobs']['seconds']:.1f} s "
                       f"+ update {st['update']['seconds']:.1f} s + outside the stages (the record, MLflow) {s['iter_s'] - inside:.1f} s "
                       f"= {s['iter_s']:.1f} s.")
        out.append(f"Checks: bare vLLM sampled the same tokens as the rollout stage: "
                   f"{chk['same_tokens'] if w.get('engine', 'vllm') == 'vllm' else '- (HF engine)'}; bare forward "
                   f"vs the stored old_logprobs{' (the update stored them: its own forward)' if s.get('no_old_pass') else ''}, "
                   f"max abs diff {chk['logprob_max_abs_diff']:.2e}.")
        out.append("")

    if any("commands" in s for s in sums.values()):
        out += ["## Separate commands (one process per stage)", "",
                "Each command is `grpo STAGE RUN --iter K` continuing the run above (`python -X importtime -m bench.cli_probe`, "
                "which calls `stages.cli.main`). interpreter start = Popen until the first line runs; imports = every module "
                "load, wherever it happens (the lazy ones inside engine start too; the process total from -X importtime in "
                "brackets); engine start = vLLM `LLM(...)` / HF model load / DeepSpeed init with the trainer-state load; "
                "MLflow = client start and logging; artifacts = Parquet, hashing, manifests, checkpoints; exit = interpreter "
                "shutdown after the command returned.", ""]
        for name, s in sums.items():
            if "commands" not in s:
                continue
            c = s["commands"]
            out.append(f"### {name}")
            out.append("")
            out.append("| command | wall s | interpreter start | imports (-X importtime) | engine start | MLflow | compute | artifacts | other | exit | peak RSS MB |")
            out.append("|---|---|---|---|---|---|---|---|---|---|---|")
            for st, p in c["stages"].items():
                out.append(f"| {st} | {p['wall_s']:.2f} | {p['startup_s']:.2f} | {p['imports_s']:.2f} ({p['import_total_s']:.2f}) | "
                           f"{p['engine_start_s']:.2f} | {p['mlflow_s']:.2f} | {p['compute_s']:.2f} | {p['artifact_s']:.2f} | "
                           f"{p['other_s']:.2f} | {p['exit_s']:.2f} | {p['peak_rss_mb']:.0f} |")
            f = c["fixed"]
            out.append("")
            out.append(f"Per iteration: {c['iteration_s']:.1f} s as four commands vs {s['iter_s']:.1f} s warm: +{c['extra_s']:.1f} s. "
                       f"Summed over the four processes: interpreter start {f['startup_s']:.1f}, imports {f['imports_s']:.1f}, "
                       f"engine start {f['engine_start_s']:.1f}, MLflow (client start + logging) {f['mlflow_s']:.1f}, "
                       f"other {f['other_s']:.1f}, interpreter exit {f['exit_s']:.1f}.")
            out.append("")
            out.append("Largest imports per command (s, -X importtime, outermost): " + "; ".join(
                f"{st}: " + ", ".join(f"{k} {v:.1f}" for k, v in list(p["top_imports"].items())[:5]) for st, p in c["stages"].items()))
            out.append("")

    if any("trl" in s for s in sums.values()):
        out += ["## Against TRL GRPOTrainer", "",
                f"TRL {m['versions'].get('trl')}, HF `generate` (use_vllm=False), same model, prompts, rewards, G, completions per "
                "generation, max new tokens, epochs (num_iterations), mini-batch, optimizer and DAPO loss; gradient checkpointing "
                "and bf16 off (where the CPU computes in bf16, TRL also runs with bf16 on, and the faster counts; for runs before "
                "2026-11-23 17:30 UTC only real-* did). One TRL cycle (one generation + its "
                "optimizer steps) = one of our iterations. real-*: TRL's mini-batch of 64 runs as micro-batches of 16 with "
                "gradient accumulation (the same optimizer step; 64 at once does not fit in 24 GB), ours by its token budget.", ""]
        out.append("| workload | TRL s/iteration (steps) | ours s/iteration | ratio | CPU s per iteration: TRL, ours (ours/TRL) | TRL generate s (CPU) | TRL tok/s | ours tok/s | TRL peak RSS MB | reward per iteration: ours | TRL |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for name, s in sums.items():
            if "trl" not in s:
                continue
            t = s["trl"]
            out.append(f"| {name} | {t['cycle_s']:.2f} ({t['steps_per_cycle']}) | {s['iter_s']:.2f} | {t['ratio']:.2f} | "
                       f"{t['cycle_cpu_s']:.2f}, {s['iter_cpu_s']:.2f} ({t['cpu_ratio']:.2f}) | {t['generate_s']:.2f} ({_f(t['generate_cpu_s'])}) | "
                       f"{t['tokens_per_s']:.0f} | {s['ours_tokens_per_s']:.0f} | {t['peak_rss_mb']:.0f} | "
                       f"{' '.join(_f(x, '.3f') for x in s['rewards'])} | {' '.join(_f(x, '.3f') for x in t['rewards'])} |")
        out.append("")
        out.append("TRL generate = TRL's `_generate_and_score_completions`: HF generate, the old-policy logprob pass and the rewards. "
                   "CPU s = process CPU seconds (all threads): on a loaded machine it is the steadier measure of work.")
        out.append("Rewards are the mean total reward (correct + 0.1 x format) of each iteration's samples, same task and seed; "
                   "the prompts differ (each samples its own), and a few iterations are too few to tell the two apart.")
        out.append("")
    profiled = [(n, s["profile"]) for n, s in sums.items() if s.get("profile")]
    if profiled:
        out += ["## Profiles", "", "One extra `grpo iterate` iteration per profiled workload under cProfile (not counted above): "
                "the top functions by own time and by cumulative time.", ""]
        for name, prof in profiled:
            for key in ("tottime", "cumulative"):
                out += [f"<details><summary>{name}: by {key}</summary>", "", "```", prof[key], "```", "", "</details>", ""]
    out += list(sides)  # the side benches' sections (bench/page.py)
    out += ["## Definitions", "",
            "- tokens/s: completion tokens processed per second (update: once per epoch).",
            "- ratio: ours / bare over the same iterations; `engine call` is the product's call into the engine alone "
            "(VLLMEngine.generate, sequence_logprobs, Trainer.train_iteration), so ratio - engine ratio is the stage's overhead.",
            "- artifact overhead: Parquet write/read, hashing, manifests (incl. `git describe` for code_version), MLflow logging and "
            "the diagnostics it triggers. Checkpoints (optimizer state, the new policy's safetensors) are listed apart: vLLM "
            "loads the new weights from them.", ""]
    return "\n".join(out)
