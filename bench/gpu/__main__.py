"""python -m bench.gpu pack | dry-run | report DIR  (see bench/gpu/__init__.py and docs/gpu.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DRY_VENV = Path(os.environ.get("GRPO_GPU_DRY_VENV", "/tmp/grpo-gpu-dry-venv"))
PY312 = os.environ.get("GRPO_PY312", "python3.12")


def python312() -> str | None:
    """A Python 3.12 that runs (a pyenv shim for a version not selected is found but fails)."""
    for exe in [shutil.which(PY312), *sorted(str(p) for p in Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))]:
        if exe and subprocess.run([exe, "--version"], capture_output=True).returncode == 0:
            return exe
    return None


def dry_run() -> int:
    """The proof at the small size on this CPU, in a Python 3.12 virtualenv holding only the GPU
    machine's packages (bench/gpu/machine.txt), brought as the device calls bring it: one call per part
    of the pack, each in a fresh copy of the tree that carries only its part (and is checked against the
    64 MiB a call carries), run.sh storing the parts in one folder that outlives the calls and, in the
    last, installing the pack with --no-deps and running the proof. Steps that need CUDA are skipped."""
    import tarfile
    import tempfile

    from bench.gpu.pack import CALL_LIMIT, PACK, PARTS_FILE, tree_files

    py = DRY_VENV / "bin" / "python"
    if not py.exists():
        exe = python312()
        if exe is None:
            print("dry-run: no Python 3.12 here (set GRPO_PY312)", file=sys.stderr)
            return 1
        subprocess.run([exe, "-m", "venv", str(DRY_VENV)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "-r", str(ROOT / "bench/gpu/machine.txt")], check=True)
    parts = sorted(PACK.glob("part-*"))
    if not parts or not (PACK / PARTS_FILE).is_file():
        print("dry-run: no pack; run `python -m bench.gpu pack` first", file=sys.stderr)
        return 1
    base = Path(tempfile.mkdtemp(prefix="grpo-gpu-dry-"))
    out = base / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"OUT": str(out), "PY": str(py), "GRPO_GPU_SITE": str(base / "site"), "GRPO_GPU_PARTS": str(base / "parts"),
            "GRPO_GPU_WORK": str(out / "work"), "PATH": f"{py.parent}:{env.get('PATH', '')}"}
    files, rc = tree_files(), 0
    for k, part in enumerate(parts):
        call = base / "call"  # the device machine's copy of the tree for this call
        shutil.rmtree(call, ignore_errors=True)
        for f in files:
            (call / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, call / f)
        (call / ".gpu-pack").mkdir()
        for f in (part, PACK / PARTS_FILE):
            shutil.copy2(f, call / ".gpu-pack" / f.name)
        size = sum(p.stat().st_size for p in call.rglob("*") if p.is_file())
        print(f"dry-run: call {k + 1} of {len(parts)}: tree + {part.name} = {size / 2**20:.1f} MiB (limit {CALL_LIMIT / 2**20:.0f})", flush=True)
        if size > CALL_LIMIT:
            print("dry-run: that call is over the limit", file=sys.stderr)
            return 1
        rc = subprocess.run(["bash", "bench/gpu/run.sh", "small", "2400", os.environ.get("GRPO_GPU_DRY_STEPS", "")], cwd=call, env=env).returncode
        if k < len(parts) - 1 and (rc or (out / "gpu.json").exists()):
            print(f"dry-run: call {k + 1} should only have stored its part (rc {rc})", file=sys.stderr)
            return 1
    result = json.loads((out / "gpu.json").read_text()) if (out / "gpu.json").is_file() else {"steps": {}}
    steps = result["steps"]
    bad = sorted(k for k, v in steps.items() if not v.get("ok") and not v.get("needs_cuda"))
    # the record that comes back audits here too, with this checkout's own install
    audits = {}
    if (out / "runs.tar.gz").is_file():
        back = out / "back"
        with tarfile.open(out / "runs.tar.gz") as tar:
            tar.extractall(back, filter="data")
        for run in sorted(p for p in back.iterdir() if p.is_dir()):
            a = subprocess.run([sys.executable, "-m", "stages.cli", "audit", str(run), "--without-weights"], cwd=ROOT,
                               capture_output=True, text=True)
            audits[run.name] = a.returncode == 0
            print(f"audit here of {run.name}: {'clean' if a.returncode == 0 else 'FAILED'}\n{(a.stdout + a.stderr)[-800:]}")
    passed = sorted(k for k, v in steps.items() if v.get("ok"))
    cuda = sorted(k for k, v in steps.items() if v.get("needs_cuda"))
    fallback = {k: v["fallback"] for k, v in steps.items() if v.get("fallback")}
    print(f"dry-run: run.sh exited {rc}; passed: {passed}; failed: {bad or 'none'}; need a GPU: {cuda}; "
          f"fell back: {fallback or 'none'}; audits here: {audits}; output in {out}")
    return 0 if not bad and audits and all(audits.values()) else 1


def main(argv: list[str]) -> int:
    cmd = argv[0] if argv else ""
    if cmd == "pack":
        from bench.gpu.pack import pack

        return pack()
    if cmd == "dry-run":
        return dry_run()
    if cmd == "report":
        from bench.gpu.report import report

        return report(*(Path(a) for a in argv[1:]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
