"""The GPU proof: every step of docs/gpu.md's "What ran on a GPU", in one command, each step timed and
recorded even when an earlier one failed, inside a time budget.

    python -m bench.gpu.proof OUT --size real|small [--budget-s 420] [--steps gpu_check,full,full-again,lora,trl]
    python -m bench.gpu.proof one-run RUN RESULT_JSON --iters N      (a step's own process)

Steps: the arithmetic check (bench.gpu_check); the assets (bench.gpu.assets); `grpo init` and
`grpo iterate` (HF engine, bf16, DeepSpeed ZeRO-2 on one GPU) for full fine-tuning, LoRA and the full
config again; `grpo audit` of each and `grpo audit --compare` of the two full runs; TRL 1.16's
GRPOTrainer on the same model and work (bench.gpu.trl_gpu); `grpo status --format json` of each run.
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
        for mod in ("transformers", "peft", "deepspeed", "polars", "pyarrow", "pydantic", "trl", "datasets", "accelerate"):
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
        for name, lora in (("full", False), ("lora", True)):
            (self.work / f"{name}.yaml").write_text(yaml.safe_dump(assets.config(model, data, reward, self.size, lora)))
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

    def trl(self) -> dict:
        res = self.work / "trl.json"
        if not (self.work / "runs" / "full").is_dir():  # TRL reads the full run's config: init it alone
            sh(grpo("init", str(self.work / "runs" / "full"), "--config", str(self.work / "full.yaml")), timeout=min(self.left(), 120))
        t = sh([sys.executable, "-m", "bench.gpu.trl_gpu", str(self.work / "runs" / "full"), str(res), "--iters", str(self.iters)],
               timeout=self.left())
        got = {"ok": t["ok"], "tail": t["tail"][-1500:]}  # its whole output is in the log
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
        self.iters = __import__("bench.gpu.assets", fromlist=["SIZES"]).SIZES[self.size]["iters"]
        steps = {
            "gpu_check": (lambda: sh([sys.executable, "-m", "bench.gpu_check"], timeout=min(self.left(), 180)), 30),
            "full": (lambda: self.run("full", "full.yaml"), 60),
            "lora": (lambda: self.run("lora", "lora.yaml"), 60),
            "trl": (self.trl, 60),
            "full-again": (lambda: self.run("full-again", "full.yaml"), 60),
            "lora-again": (lambda: self.run("lora-again", "lora.yaml"), 60),
        }
        self.step("environment", self.environment, 0)
        if not self.step("assets", self.assets, 20):
            return 1
        for name in self.only or ["gpu_check", "full", "full-again", "lora", "trl"]:  # the rerun first: reproducibility is the claim
            self.step(name, *steps[name])
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
