"""What both generation engines (pipeline.models.vllm_engine, pipeline.models.hf_engine) and their
callers share: a sample, the CPU environment, the dtype and context rules. Below `engines`, which
picks an engine, so that the engines can use these without importing the module that imports them."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from pipeline.models.device_budget import engine_dtype, may_have_gpu  # noqa: F401  (engine_dtype: the engines import it from here)


@dataclass
class Sample:
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"


def files_ready(model_dir: Path) -> None:
    """What an engine calls before it reads weights from a model directory: nothing to wait for
    here. An engine sampling a run's policies is handed the run's own when it is made
    (pipeline.rollout.policy_engine: a policy whose write is in flight is settled), which models cannot import."""


def cpu_env() -> None:
    """Environment the engines need on a CPU machine; set before vLLM/DeepSpeed import."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if not may_have_gpu():  # on a GPU DeepSpeed finds its CUDA accelerator itself (asked without torch)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its CPU notes drown the demo table
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # a weight-loading bar per model load


@contextlib.contextmanager
def environment_kept():
    """Put os.environ back as it was. vLLM sets variables for its worker processes as it
    imports and starts (LD_PRELOAD of torch's libgomp, KMP_*, LD_LIBRARY_PATH,
    LOCAL_WORLD_SIZE, ...); its worker runs in this process here, so they would only leak into
    every process started later (a reward sandbox, a test's `grpo` command), which would then
    load other libraries than one started before any engine."""
    before = dict(os.environ)
    try:
        yield
    finally:
        for key in set(os.environ) - set(before):
            del os.environ[key]
        os.environ.update(before)


def model_context(model_dir: Path) -> int:
    import json

    conf = json.loads((Path(model_dir) / "config.json").read_text())
    return int(conf.get("max_position_embeddings") or 2048)
