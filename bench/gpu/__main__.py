"""python -m bench.gpu pack | dry-run | report DIR  (see bench/gpu/__init__.py and docs/gpu.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DRY_VENV = Path(os.environ.get("GRPO_GPU_DRY_VENV", "/tmp/grpo-gpu-dry-venv"))
PY312 = os.environ.get("GRPO_PY312", "python3.12")


def dry_run() -> int:
    """The proof at the small size on this CPU, in a Python 3.12 virtualenv holding only the GPU
    machine's packages (bench/gpu/machine.txt) plus the pack, installed as run.sh installs it there."""
    import shutil
    import tarfile
    import tempfile

    py = DRY_VENV / "bin" / "python"
    if not py.exists():
        exe = shutil.which(PY312) or next(iter(sorted(Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))), None)
        if exe is None:
            print("dry-run: no Python 3.12 here (set GRPO_PY312)", file=sys.stderr)
            return 1
        subprocess.run([str(exe), "-m", "venv", str(DRY_VENV)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "-r", str(ROOT / "bench/gpu/machine.txt")], check=True)
    if not any((ROOT / ".gpu-pack").glob("*.whl")):
        print("dry-run: no pack; run `python -m bench.gpu pack` first", file=sys.stderr)
        return 1
    out = Path(tempfile.mkdtemp(prefix="grpo-gpu-dry-"))
    site = Path(tempfile.mkdtemp(prefix="grpo-gpu-site-"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"OUT": str(out), "PY": str(py), "GRPO_GPU_SITE": str(site), "GRPO_GPU_WORK": str(out / "work"),
            "PATH": f"{py.parent}:{env.get('PATH', '')}"}
    rc = subprocess.run(["bash", "bench/gpu/run.sh", "small", "2400", "full,full-again,lora,trl"], cwd=ROOT, env=env).returncode
    result = json.loads((out / "gpu.json").read_text()) if (out / "gpu.json").is_file() else {"steps": {}}
    bad = {k: v for k, v in result["steps"].items() if not v.get("ok") and k != "gpu_check"}  # no CUDA here
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
    print(f"dry-run: run.sh exited {rc}; failed steps: {sorted(bad) or 'none'}; audits here: {audits}; output in {out}")
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
