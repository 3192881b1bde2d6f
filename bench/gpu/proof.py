"""The GPU proof: every step of docs/gpu.md's "What ran on a GPU", in one command, each step timed and
recorded even when an earlier one failed, inside a time budget.

    python -m bench.gpu.proof OUT --size real|small [--budget-s 420] [--steps full,full-vllm,...]
    python -m bench.gpu.proof one-run RUN RESULT_JSON --iters N      (a step's own process)

Steps, in ORDER (what the issue must have first; each later one runs only if its time is left):
`vllm_api` (vLLM 0.26 takes every argument the pipeline's and TRL's engines pass it: no GPU needed);
`grpo init` and `grpo iterate` (bf16, DeepSpeed ZeRO-2 on one GPU) for full fine-tuning with the HF
engine (`full`) and with vLLM, weights handed to it in memory (`full-vllm`); TRL 1.16's GRPOTrainer on
the same model and work with HF generate (`trl`); the full config again (`full-again`, `grpo audit
--compare` against `full`); TRL with its vLLM colocate mode (`trl-vllm`, falling back to HF generate, and
saying so, where vLLM does not run); LoRA and LoRA again (`lora`, `lora-again`, compared); the
arithmetic check (`gpu_check`); `grpo audit` and `grpo status --format json` of each run.
Each iterate runs in its own process, which records seconds per iteration and stage and torch's peak
GPU memory beside device_budget's estimates. OUT gets gpu.json (every figure and each step's outcome)
and runs.tar.gz (the runs' manifests and parts, not their policies), which `grpo audit` checks
here too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def sh(args: list[str], timeout: float, log: Path | None = None) -> dict:
    """Run a step's command; its output goes to our stdout (the proof's log) and the result says how it ended."""
    t = time.time()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), "PYTHONUNBUFFERED": "1"}
    print(f"$ {' '.join(args)}", flush=True)
    try:
        p = subprocess.run(args, cwd=ROOT, env=env, timeout=max(timeout, 1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out, rc = p.stdout, p.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
    sys.stdout.write(out)
    sys.stdout.flush()
    return {"ok": rc == 0, "rc": rc, "seconds": round(time.time() - t, 2), "tail": out[-2000:], "out": out}


def grpo(*args: str) -> list[str]:
    return [sys.executable, "-m", "stages.cli", *args]


def one_run(run: str, result: str, iters: int) -> None:
    """`grpo iterate RUN --iters N` in this process, so torch's peak GPU memory is this run's."""
    import torch

    from pipeline.loop.iterate import iterate
    from pipeline.models.device_budget import ModelShape, this_device, trainer_bytes
    from pipeline.run.run import Run

    cuda = torch.cuda.is_available()
    r = Run(run)
    rows: list[dict] = []
    t0 = time.time()
    iterate(r, iters, on_iteration=lambda row: (rows.append(row), print(f"iteration {row['iteration']}: {row['seconds']:.1f} s "
                                                                         f"{ {k: round(v, 1) for k, v in row['timings'].items()} }", flush=True)))
    shape = ModelShape.from_dir(Path(r.cfg.model) if Path(r.cfg.model).is_dir() else Path(run) / "policy" / "iter-0000")
    resident, peak = trainer_bytes(shape, r.policy, this_device())
    out = {
        "wall_s": time.time() - t0,
        "rows": rows,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "max_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
        "estimate": {"trainer_resident_gib": resident / 2**30, "trainer_peak_gib": peak / 2**30, "params": shape.params},
    }
    if cuda:  # the estimate beside what ran, so each lease checks it (bench/gpu/report.py's bound)
        print(f"trainer peak: estimated {peak / 2**30:.1f} GiB, measured {out['max_allocated_gib']:.1f} GiB allocated "
              f"({peak / 2**30 / max(out['max_allocated_gib'], 1e-9):.2f} x)", flush=True)
    Path(result).write_text(json.dumps(out, indent=1, default=str))


ORDER = ["vllm_api", "full", "full-vllm", "trl", "full-again", "trl-vllm", "lora", "lora-again", "gpu_check"]
"""The proof's steps, must-haves first: grpo on each engine and TRL's HF-generate time the issue's bounds are
against, the full rerun's bytes, then TRL's own vLLM mode, LoRA and its rerun, the arithmetic check."""
NEEDS_CUDA = {"full-vllm": "the CUDA vLLM wheel samples on a GPU only", "gpu_check": "it compares CUDA with the CPU"}
"""Steps that cannot run without CUDA, and why: the dry run on a CPU records them as skipped."""
NEED_S = {"vllm_api": 5, "full": 60, "full-vllm": 90, "trl-vllm": 80, "full-again": 60, "trl": 60, "lora": 60,
          "lora-again": 60, "gpu_check": 30}
"""Seconds a step needs at the real size on an H200 to be started (the first lease's times, vLLM's start
with CUDA graphs estimated): a step with less left is skipped and says so."""


def llm_kwargs(source: Path) -> set[str]:
    """The keyword names a file passes to `LLM(...)` (its `**` expansions' literal dicts included)."""
    import ast

    names: set[str] = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "LLM":
            for kw in node.keywords:
                if kw.arg:
                    names.add(kw.arg)
                else:  # **(dict(a=...) if ... else {})
                    for sub in ast.walk(kw.value):
                        if isinstance(sub, ast.Call) and getattr(sub.func, "id", None) == "dict":
                            names |= {k.arg for k in sub.keywords if k.arg}
    return names


def vllm_api() -> dict:
    """vLLM as installed takes what the pipeline's engine and TRL's colocate mode pass it: every module
    the pack's import trace names imports (bench.gpu.pack.VLLM_TRACE: nothing the pack left out is
    needed to generate); every `LLM(...)` keyword is an `LLM` or `EngineArgs` parameter; the model
    runner's `reload_weights` takes weights in memory; `LLM` has sleep, wake_up and collective_rpc.
    Imports and signatures only: no GPU."""
    import dataclasses
    import importlib
    import inspect

    import vllm
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from bench.gpu.pack import VLLM_TRACE

    accepted = set(inspect.signature(LLM.__init__).parameters) | {f.name for f in dataclasses.fields(EngineArgs)}
    got: dict = {"ok": True, "vllm": vllm.__version__, "imports_failed": {}, "imports_need_driver": []}
    for mod in VLLM_TRACE:
        try:
            importlib.import_module(mod)
        except ImportError as e:
            if "libcuda.so.1" in str(e):  # the CUDA driver's library: on the GPU machine, not here
                got["imports_need_driver"].append(mod)
            else:
                got["imports_failed"][mod] = f"{type(e).__name__}: {e}"
    got["ok"] &= not got["imports_failed"]
    sources = {"pipeline": ROOT / "pipeline/models/vllm_engine.py"}
    try:
        import trl

        sources["trl"] = Path(trl.__file__).parent / "generation" / "vllm_generation.py"
    except ImportError as e:
        got["trl"] = f"not checked ({e})"
    for who, src in sources.items():
        passed = llm_kwargs(src)
        unknown = sorted(passed - accepted)
        got[who] = {"kwargs": sorted(passed), "unknown": unknown}
        got["ok"] &= bool(passed) and not unknown
    reload = set(inspect.signature(GPUModelRunner.reload_weights).parameters)
    got["reload_weights"] = sorted(reload)
    got["ok"] &= {"weights_iterator", "weights_path", "is_checkpoint_format"} <= reload
    missing = [m for m in ("sleep", "wake_up", "collective_rpc", "generate") if not hasattr(LLM, m)]
    got["llm_methods_missing"] = missing
    got["ok"] &= not missing
    return got


class Proof:
    def __init__(self, out: Path, size: str, budget_s: float):
        self.out, self.size, self.deadline = out, size, time.time() + budget_s
        self.work = Path(os.environ.get("GRPO_GPU_WORK", "/tmp/grpo-gpu"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.result: dict = {"size": size, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "steps": {}}

    def left(self) -> float:
        return self.deadline - time.time()

    def step(self, name: str, fn, need_s: float):
        """Run step `name` if `need_s` seconds are left; its outcome goes into gpu.json at once."""
        if self.left() < need_s:
            self.result["steps"][name] = {"ok": False, "skipped": f"{self.left():.0f} s left, the step needs ~{need_s:.0f}"}
            print(f"== {name}: skipped ({self.left():.0f} s left)", flush=True)
            return None
        print(f"== {name} ({self.left():.0f} s left)", flush=True)
        t = time.time()
        try:
            got = fn()
        except Exception as e:  # a step's failure is a finding: record it and go on
            got = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        got = got if isinstance(got, dict) else {"ok": True, "value": got}
        got.setdefault("seconds", round(time.time() - t, 2))
        self.result["steps"][name] = got
        print(f"== {name}: {'ok' if got.get('ok') else 'FAILED'} in {got['seconds']} s", flush=True)
        self.save()
        return got

    def save(self) -> None:
        (self.out / "gpu.json").write_text(json.dumps(self.result, indent=1, default=str))

    # -- the steps ------------------------------------------------------------------------
    def environment(self) -> dict:
        import torch

        info = {"ok": True, "torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info |= {"gpu": p.name, "gpu_memory_gib": p.total_memory / 2**30, "bf16": torch.cuda.is_bf16_supported()}
        for mod in ("transformers", "peft", "deepspeed", "polars", "pyarrow", "pydantic", "trl", "datasets", "accelerate", "vllm"):
            try:
                info[mod] = __import__(mod).__version__
            except Exception as e:
                info[mod] = f"missing ({type(e).__name__})"
        self.result["environment"] = info
        return info

    def assets(self) -> dict:
        from bench.gpu import assets

        s = assets.SIZES[self.size]
        model = assets.build_model(self.work / "model", s["shape"])
        data = assets.write_data(self.work / "prompts.jsonl", s["prompts"] * (s["iters"] + 1))
        reward = f"{HERE / 'reward.py'}:letters"
        for name, lora, engine in (("full", False, "hf"), ("lora", True, "hf"), ("full-vllm", False, "vllm")):
            (self.work / f"{name}.yaml").write_text(yaml.safe_dump(assets.config(model, data, reward, self.size, lora, engine)))
        return {"ok": True, "model": str(model), "config": assets.config(model, data, reward, self.size, False)}

    def run(self, name: str, config: str) -> dict:
        run = self.work / "runs" / name
        init = sh(grpo("init", str(run), "--config", str(self.work / config)), timeout=self.left())
        if not init["ok"]:
            return {"ok": False, "init": init}
        res = self.work / f"{name}.json"
        it = sh([sys.executable, "-m", "bench.gpu.proof", "one-run", str(run), str(res), "--iters", str(self.iters)], timeout=self.left())
        got = {"ok": it["ok"], "init_s": init["seconds"], "iterate": {k: v for k, v in it.items() if k != "out"}}
        if res.is_file():
            got |= json.loads(res.read_text())
        audit = sh(grpo("audit", str(run)), timeout=min(self.left(), 300))
        status = sh(grpo("status", str(run), "--format", "json"), timeout=min(self.left(), 120))
        got["audit"] = {"ok": audit["ok"], "tail": audit["tail"][-600:]}
        try:
            got["status"] = json.loads(status["out"] if status["ok"] else "null")
        except json.JSONDecodeError:
            got["status"] = status["tail"][-1500:]
        got["ok"] = got["ok"] and audit["ok"]
        return got

    def compare(self, a: str, b: str) -> dict:
        runs = self.work / "runs"
        c = sh(grpo("audit", "--compare", str(runs / a), str(runs / b)), timeout=min(self.left(), 300))
        return {"ok": c["ok"], "tail": c["tail"][-3000:]}  # the first difference, if any

    def trl(self, vllm: bool = False) -> dict:
        """TRL on the full run's config; with `vllm` its colocate mode, and where that fails HF generate,
        the result saying so (`fallback`, `vllm_error`)."""
        res = self.work / ("trl-vllm.json" if vllm else "trl.json")
        if not (self.work / "runs" / "full").is_dir():  # TRL reads the full run's config: init it alone
            sh(grpo("init", str(self.work / "runs" / "full"), "--config", str(self.work / "full.yaml")), timeout=min(self.left(), 120))
        cmd = [sys.executable, "-m", "bench.gpu.trl_gpu", str(self.work / "runs" / "full"), str(res), "--iters", str(self.iters)]
        t = sh(cmd + (["--vllm"] if vllm else []), timeout=self.left())
        got = {"ok": t["ok"], "tail": t["tail"][-1500:]}  # its whole output is in the log
        if vllm and not t["ok"] and self.left() > NEED_S["trl"]:
            print("== trl-vllm: TRL's vLLM colocate mode failed; HF generate instead", flush=True)
            t = sh(cmd, timeout=self.left())
            got = {"ok": t["ok"], "tail": t["tail"][-1500:], "fallback": "hf generate", "vllm_error": got["tail"][-1500:]}
        if res.is_file():
            got |= json.loads(res.read_text())
        return got

    def tarball(self) -> dict:
        """The runs without their policies or engine caches: manifests, parts, configs, metrics."""
        path = self.out / "runs.tar.gz"
        with tarfile.open(path, "w:gz") as tar:
            for run in sorted((self.work / "runs").glob("*")):
                for f in sorted(run.rglob("*")):
                    rel = f.relative_to(self.work / "runs")
                    weights = "policy" in rel.parts and f.name != "MANIFEST.json"  # audited here with --without-weights
                    if f.is_file() and not weights and f.stat().st_size < 8 * 2**20:
                        tar.add(f, arcname=str(rel))
        return {"ok": path.stat().st_size < 15 * 2**20, "bytes": path.stat().st_size}

    def main(self) -> int:
        import torch

        self.iters = __import__("bench.gpu.assets", fromlist=["SIZES"]).SIZES[self.size]["iters"]
        steps = {
            "vllm_api": vllm_api,
            "gpu_check": lambda: sh([sys.executable, "-m", "bench.gpu_check"], timeout=min(self.left(), 180)),
            "full": lambda: self.run("full", "full.yaml"),
            "full-vllm": lambda: self.run("full-vllm", "full-vllm.yaml"),
            "trl-vllm": lambda: self.trl(vllm=True),
            "trl": self.trl,
            "full-again": lambda: self.run("full-again", "full.yaml"),
            "lora": lambda: self.run("lora", "lora.yaml"),
            "lora-again": lambda: self.run("lora-again", "lora.yaml"),
        }
        self.step("environment", self.environment, 0)
        if not self.step("assets", self.assets, 20):
            return 1
        cuda = torch.cuda.is_available()
        for name in [n for n in ORDER if n in (self.only or ORDER)]:
            if not cuda and name in NEEDS_CUDA:
                self.result["steps"][name] = {"ok": False, "skipped": f"no CUDA here: {NEEDS_CUDA[name]}", "needs_cuda": True}
                print(f"== {name}: skipped (no CUDA here)", flush=True)
                continue
            self.step(name, steps[name], NEED_S[name])
            if name.endswith("-again") and (self.work / "runs" / name).is_dir():
                self.step(f"compare-{name[:-6]}", lambda: self.compare(name[:-6], name), 10)
        self.step("tarball", self.tarball, float("-inf"))  # whatever ran comes back
        self.result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        self.save()
        steps = self.result["steps"]
        print("\nstep            ok     seconds")
        for name, s in steps.items():
            print(f"{name:<15} {'yes' if s.get('ok') else ('skip' if 'skipped' in s else 'NO'):<6} {s.get('seconds', '-')}")
        return 0 if all(s.get("ok") for s in steps.values()) else 1


def main(argv: list[str]) -> int:
    if argv and argv[0] == "one-run":
        one_run(argv[1], argv[2], int(argv[argv.index("--iters") + 1]))
        return 0
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    size = argv[argv.index("--size") + 1] if "--size" in argv else "real"
    budget = float(argv[argv.index("--budget-s") + 1]) if "--budget-s" in argv else 420.0
    proof = Proof(out, size, budget)
    proof.only = argv[argv.index("--steps") + 1].split(",") if "--steps" in argv else None
    return proof.main()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
