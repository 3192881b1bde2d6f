"""Which GPU kernels the forward passes may use: those that give the same numbers every call.
Imports nothing of the pipeline, so the engines, the trainer and the logprob models can all call it."""

from __future__ import annotations


def same_kernels_every_run() -> None:
    """On a GPU, leave out the one attention kernel whose results vary from call to call: torch's
    cuDNN scaled-dot-product attention. The GPU proof (bench/gpu/determinism.py, an H200, torch
    2.11+cu130) sampled the same bf16 rollout twice in one process and got different tokens from
    about the 85th on, with or without torch's deterministic mode and CUBLAS_WORKSPACE_CONFIG;
    with cuDNN's attention off (flash / memory-efficient / math remain), the same tokens every
    time. For the HF engine and the trainer (bf16 under autocast), which both reach SDPA; vLLM
    runs its own attention. Process-wide; a no-op on a CPU."""
    import torch

    if torch.cuda.is_available():
        torch.backends.cuda.enable_cudnn_sdp(False)
