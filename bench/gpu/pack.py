"""The pack: the wheels the GPU machine lacks for the proof, for its Python 3.12 on x86-64 Linux, with a
slimmed vLLM 0.26, as one tar.xz split into parts that each travel in one device call beside the tree.

    python -m bench.gpu pack

The GPU machine has torch 2.11 (CUDA 13), transformers, peft, accelerate, pyarrow, typer, rich, httpx,
pyyaml, numpy, pandas and the rest of bench/gpu/machine-names.txt, and no package registry. The proof
needs DeepSpeed, polars, pydantic and math-verify (the pipeline's own dependencies), TRL 1.16 with
`datasets` (the comparison) and vLLM. MLflow stays behind: the proof's runs set `tracking.mlflow: false`.

polars is pinned to 1.30 here, not the 2.x the CPU install resolves: polars 2 splits its engine into
`polars-runtime-32`, a 54 MB wheel; the pipeline's `polars>=1.20` admits both, and the dry run runs the
pipeline on 1.30. DeepSpeed publishes only a source archive: it is built here into a pure-Python wheel
(no ops prebuilt; on a GPU its ops are JIT-built where needed, and the pipeline's optimizer needs none).

vLLM 0.26.0 is the newest vLLM built for the machine's torch 2.11 (CUDA 13). Its wheel is 304 MB and
pins ~70 packages; it goes as `--no-deps` with only the packages `from vllm import LLM` and the modules
an offline engine loads to generate on CUDA import (VLLM_DEPS: found by importing them in the dry run's
Python 3.12 venv of the machine's packages, each missing module's package added until all imported;
versions as pip resolved vLLM 0.26.0's pins for that Python, 2026-11-28), and without what a dense
model on Hopper (sm_90) never loads (VLLM_STRIP). The rest of its pins (flashinfer, tilelang, the
cutlass DSL, MoE and MLA kernel packages, the OpenAI server's fastapi extras, telemetry, mistral_common,
video codecs) serve attention backends, models or the server the proof does not use.

The parts: the wheels as one tar, xz-compressed, cut into parts of at most `part_bytes()` so that each
device call (the tree plus one part) stays under the 64 MiB a call carries. Every call runs the same
command (`bash bench/gpu/run.sh real`); its `carry` names one part and `.gpu-pack/parts.sha256`; run.sh
moves the part out of the call's tree copy to a folder that stays on the warm machine
(/var/tmp/grpo-gpu-parts) and, once every part is there, joins, checks and installs them and runs the
proof. `device_calls()` prints the calls; docs/gpu.md has them.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACK = ROOT / ".gpu-pack"
CACHE = Path(os.environ.get("GRPO_GPU_CACHE", Path.home() / ".cache" / "grpo-gpu-pack"))
CALL_LIMIT = 64 * 2**20
"""What one device call carries: the tree (tracked and untracked-not-ignored files) and its `carry` paths."""
MARGIN = 3 * 2**20
"""Room left in each call for the tree to grow between `pack` and the calls, and for the checksum file."""

WHEELS = [
    "polars==1.30.0",
    "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5",
    "typing-extensions==4.16.0",
    "math-verify==0.9.0", "latex2sympy2_extended==1.11.0", "antlr4-python3-runtime==4.13.2",
    "hjson==3.1.0",
    "trl==1.16.0", "datasets==4.8.0", "dill==0.4.0", "multiprocess==0.70.18",
]
VLLM = "vllm==0.26.0"
VLLM_DEPS = [
    # imported by `from vllm import LLM` (engine core, request and structured-output types, the
    # chat-template and tool-call protocol types the offline entrypoint shares with the server)
    "cbor2==6.3.0", "pyzmq==27.3.0", "msgspec==0.22.0", "pybase64==1.5.1", "cachetools==8.0.2",
    "llguidance==1.7.6", "xgrammar==0.2.7", "apache-tvm-ffi==0.1.10", "partial-json-parser==0.2.1.1.post7",
    "openai-harmony==0.0.8", "openai==3.57.0", "httpx2==2.16.2", "httpcore2==2.16.2", "jiter==0.19.0",
    "sniffio==1.3.1", "truststore==0.10.5", "fastapi==0.136.3", "starlette==1.10.0",
    # imported by vLLM's torch.compile wrapper once CUDA graphs are captured
    "depyf==0.20.0", "astor==0.8.1",
]
VLLM_TRACE = """vllm.entrypoints.llm vllm.sampling_params vllm.lora.request vllm.v1.engine.llm_engine vllm.v1.engine.core
vllm.v1.engine.core_client vllm.v1.executor.uniproc_executor vllm.platforms.cuda vllm.device_allocator.cumem
vllm.v1.worker.gpu_worker vllm.v1.worker.gpu_model_runner vllm.model_executor.models.qwen2 vllm.model_executor.models.llama
vllm.model_executor.model_loader.default_loader vllm.v1.attention.backends.flash_attn vllm.vllm_flash_attn.flash_attn_interface
vllm.v1.attention.backends.triton_attn vllm.v1.sample.sampler vllm.v1.sample.ops.topk_topp_sampler vllm.v1.core.sched.scheduler
vllm.compilation.backends vllm.compilation.wrapper vllm.compilation.cuda_graph vllm.v1.structured_output
vllm.distributed.parallel_state vllm.distributed.device_communicators.pynccl vllm.model_executor.warmup.kernel_warmup
vllm.lora.worker_manager vllm.lora.layers vllm.tokenizers""".split()
"""The modules an offline vLLM engine loads to generate with a dense model on CUDA, as VLLM_DEPS was
found by importing them (the proof's `vllm_api` step imports them again wherever it runs; on a machine
without the CUDA driver, those that load libcuda.so.1 count as imported when that is all they miss)."""
VLLM_STRIP = [
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",  # FlashAttention 2: Hopper runs FA3 (optional import)
    "vllm/_moe_C_stable_libtorch.abi3.so",  # mixture-of-experts kernels (import suppressed when absent)
    "vllm/vllm-rs",  # the Rust API-server front end
    "vllm/_flashmla_C.abi3.so", "vllm/_flashmla_extension_C.abi3.so",  # MLA attention (DeepSeek-style models)
    "vllm/_qutlass_C.abi3.so",  # Blackwell fp4 quantization (optional import)
    "vllm/_rust_tool_parser.abi3.so",  # the server's tool-call parser
    "vllm/third_party/deep_gemm/",  # fp8 block GEMMs (found by find_spec, absent = unused)
    "vllm/third_party/fmha_sm100/",  # Blackwell sparse attention
]
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
            *[a for p in ("manylinux_2_31", "manylinux_2_28", "manylinux_2_27", "manylinux_2_26", "manylinux_2_24", "manylinux_2_17",
                          "manylinux2014", "manylinux_2_5", "manylinux1") for a in ("--platform", f"{p}_x86_64")]]
PARTS_FILE = "parts.sha256"


def tree_files() -> list[Path]:
    """What the device call sends besides its carry: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout.split(b"\0")
    return [Path(f.decode()) for f in out if f and (ROOT / f.decode()).is_file()]


def tree_bytes() -> int:
    return sum((ROOT / f).stat().st_size for f in tree_files())


def part_bytes(tree: int) -> int:
    """The largest part one call carries beside a tree of `tree` bytes."""
    return CALL_LIMIT - tree - MARGIN


def _norm(name: str) -> str:
    return name.split("==")[0].lower().replace("_", "-").replace(".", "-")


def slim_vllm(wheel: Path, out: Path) -> tuple[int, int]:
    """`wheel` without VLLM_STRIP's files, stored uncompressed (xz compresses the whole pack better),
    its RECORD without their lines. Returns (bytes kept, bytes dropped), uncompressed."""
    kept = dropped = 0
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            if any(info.filename == s or (s.endswith("/") and info.filename.startswith(s)) for s in VLLM_STRIP):
                dropped += info.file_size
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line for line in io.BytesIO(data)
                                if not any(line.startswith(s.encode()) for s in VLLM_STRIP))
            info.compress_type = zipfile.ZIP_STORED
            dst.writestr(info, data)
            kept += info.file_size
    return kept, dropped


def download(specs: list[str], dest: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", *PLATFORM, "-d", str(dest), *specs], check=True)


def device_calls(n: int) -> list[dict]:
    """The device `run` calls that bring the pack and run the proof: the same command, one part each."""
    return [{"command": "bash bench/gpu/run.sh real", "carry": [f".gpu-pack/part-{k:02d}", f".gpu-pack/{PARTS_FILE}"],
             "timeout_s": 600} for k in range(n)]


def pack() -> int:
    wheels = PACK / "wheels"
    if PACK.exists():
        shutil.rmtree(PACK)
    wheels.mkdir(parents=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    download(WHEELS + VLLM_DEPS, wheels)
    # DeepSpeed: a source archive only, built without its ops into a py3-none-any wheel
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), "deepspeed==0.19.8"],
                   check=True, env={**os.environ, "DS_BUILD_OPS": "0", "DS_ACCELERATOR": "cpu"})
    if not any(CACHE.glob("vllm-0.26.0-*.whl")):
        download([VLLM], CACHE)
    full = next(CACHE.glob("vllm-0.26.0-*.whl"))
    kept, dropped = slim_vllm(full, wheels / full.name)
    got = {_norm(w.name.split("-")[0]) for w in wheels.glob("*.whl")}
    missing = {_norm(s) for s in [*WHEELS, *VLLM_DEPS, VLLM, "deepspeed"]} - got
    if missing:
        print(f"pack: missing wheels: {sorted(missing)}", file=sys.stderr)
        return 1
    for w in sorted(wheels.glob("*.whl")):
        print(f"{w.stat().st_size / 2**20:8.2f} MiB  {w.name}")
    print(f"vLLM {full.stat().st_size / 2**20:.0f} MiB wheel: {kept / 2**20:.0f} MiB kept, {dropped / 2**20:.0f} MiB stripped "
          f"(uncompressed)")
    # one tar of the wheels, xz-compressed, cut into parts
    tar_xz = PACK / "pack.tar.xz"
    with tarfile.open(PACK / "pack.tar", "w") as tar:
        for w in sorted(wheels.glob("*.whl")):
            tar.add(w, arcname=w.name)
    subprocess.run(["xz", "-9", "-T2", "-f", str(PACK / "pack.tar")], check=True)
    tree = tree_bytes()
    size, k, step = tar_xz.stat().st_size, *split(tar_xz, part_bytes(tree))
    tar_xz.unlink()
    shutil.rmtree(wheels)
    print(f"pack.tar.xz {size / 2**20:.1f} MiB in {k} parts of at most {step / 2**20:.1f} MiB; tree {tree / 2**20:.1f} MiB; "
          f"each call {tree / 2**20:.1f} + part <= {(tree + step) / 2**20:.1f} MiB (limit {CALL_LIMIT / 2**20:.0f})")
    print(render_calls(k))
    return 0


def split(tar_xz: Path, most: int) -> tuple[int, int]:
    """Cut `tar_xz` into the fewest parts of at most `most` bytes, of equal size (each call carries about
    as much), beside it; write their sha256 and the whole's. Returns (parts, bytes a part)."""
    data = tar_xz.read_bytes()
    n = -(-len(data) // most)
    step = -(-len(data) // n)
    sums = [f"{hashlib.sha256(data).hexdigest()}  pack.tar.xz"]
    for k in range(n):
        chunk = data[k * step:(k + 1) * step]
        (tar_xz.parent / f"part-{k:02d}").write_bytes(chunk)
        sums.append(f"{hashlib.sha256(chunk).hexdigest()}  part-{k:02d}")
    (tar_xz.parent / PARTS_FILE).write_text("\n".join(sums) + "\n")
    return n, step


def render_calls(n: int) -> str:
    """The device calls as docs/gpu.md gives them, back to back on a warm machine (it stays warm 30 s)."""
    lines = [f"Device calls ({n}), back to back (a machine stays warm 30 s after a call):"]
    for k, c in enumerate(device_calls(n)):
        lines.append(f"  {k + 1}. run(command={c['command']!r}, carry={c['carry']!r}, timeout_s={c['timeout_s']})")
    return "\n".join(lines)
