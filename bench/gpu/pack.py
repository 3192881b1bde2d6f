"""The pack: the wheels the GPU machine lacks for the proof, for its Python 3.12 on x86-64 Linux,
in `.gpu-pack/` (ignored by git, carried by the device call beside the tree).

    python -m bench.gpu pack

The GPU machine has torch 2.11 (CUDA 13), transformers, peft, accelerate, pyarrow, typer, rich, httpx,
pyyaml, numpy, pandas and the rest of bench/gpu/machine.txt, and no package registry. The proof
needs DeepSpeed, polars, pydantic and math-verify (the pipeline's own dependencies) and TRL 1.16 with
`datasets` (the comparison). MLflow stays behind: with its dependencies it would not fit one call
beside polars, and the proof's runs set `tracking.mlflow: false`.

polars is pinned to 1.30 here, not the 2.x the CPU install resolves: polars 2 splits its engine into
`polars-runtime-32`, a 54 MB wheel, and the tree plus the pack must stay under 60 MiB (one device call
carries 64 MiB); the pipeline's `polars>=1.20` admits both, and the dry run runs the pipeline on 1.30.
DeepSpeed publishes only a source archive: it is built here into a pure-Python wheel (no ops prebuilt;
on a GPU its ops are JIT-built where needed, and the pipeline's optimizer needs none).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACK = ROOT / ".gpu-pack"
LIMIT = 60 * 2**20

WHEELS = [
    "polars==1.30.0",
    "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5",
    "typing-extensions==4.16.0",
    "math-verify==0.9.0", "latex2sympy2_extended==1.11.0", "antlr4-python3-runtime==4.13.2",
    "hjson==3.1.0",
    "trl==1.16.0", "datasets==4.8.0", "dill==0.4.0", "multiprocess==0.70.18",
]
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
            *[a for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64") for a in ("--platform", p)]]


def tree_bytes() -> int:
    """What the device call sends besides the pack: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / f.decode()).stat().st_size for f in out if f and (ROOT / f.decode()).is_file())


def pack() -> int:
    if PACK.exists():
        shutil.rmtree(PACK)
    PACK.mkdir()
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "download", "--no-deps", "-q", *PLATFORM, "-d", str(PACK), *WHEELS], check=True)
    # DeepSpeed: a source archive only, built without its ops into a py3-none-any wheel
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(PACK), "deepspeed==0.19.8"], check=True,
                   env={**__import__("os").environ, "DS_BUILD_OPS": "0", "DS_ACCELERATOR": "cpu"})
    wheels = sorted(PACK.glob("*.whl"))
    names = {w.name.split("-")[0].lower().replace("_", "-") for w in wheels}
    want = {w.split("==")[0].lower().replace("_", "-") for w in WHEELS} | {"deepspeed"}
    missing = want - names
    if missing:
        print(f"pack: missing wheels: {sorted(missing)}", file=sys.stderr)
        return 1
    size, tree = sum(w.stat().st_size for w in wheels), tree_bytes()
    for w in wheels:
        print(f"{w.stat().st_size / 2**20:8.2f} MiB  {w.name}")
    print(f"pack {size / 2**20:.1f} MiB + tree {tree / 2**20:.1f} MiB = {(size + tree) / 2**20:.1f} MiB (limit {LIMIT / 2**20:.0f})")
    if size + tree > LIMIT:
        print("pack: the tree and the pack do not fit one device call", file=sys.stderr)
        return 1
    return 0
