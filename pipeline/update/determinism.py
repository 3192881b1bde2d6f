"""What makes an update the same bytes on every path to it: torch's deterministic kernels on a CPU
(`serial_accumulation`), its attention kernel there (`piece_attention`, chosen from the piece's
shape alone) and the RNG it draws from (`update_rng`).

`update_rng`: LoRA dropout (train.lora.dropout) draws from torch's RNG, seeded from (seed,
iteration, rank) at the update's start, so what update K draws does not depend on what ran before
it in the process. A warm trainer (`iterate`) ran rollouts and logprob passes between updates, a
resumed one starts fresh, and a re-run (train.state_every) runs updates back to back; with the
process's own RNG each drew other dropout masks, so a resume was not the uninterrupted run and a
re-run stopped on a policy hash it could not reproduce. (TRL keeps the process RNG in its
checkpoints, rng_state.pth; here the state would also have to hold the rollouts' draws.) The
process's RNG is left as it was outside the update.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch


@contextlib.contextmanager
def update_rng(device: torch.device, seed: int, k: int, rank: int):
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(int(np.random.SeedSequence([seed, k, rank]).generate_state(1)[0]))
        yield


@contextlib.contextmanager
def serial_accumulation(device: torch.device):
    """torch's deterministic kernels inside, on a CPU. The backward of an index with repeated
    rows (each completion takes its prompt's keys and values from the shared KV cache) adds
    into the prompt's gradient rows; on a CPU with more than one thread torch does that with
    atomic float adds whose order follows the thread schedule, so a trainer competing for its
    cores (the sampler of `train.max_staleness`, another job) gave gradients differing in the
    last bits. The deterministic kernel adds in index order: bit-identical updates, and no
    slower (0.9 ms against 4.3 ms for one layer's keys of 8 prompts x 8 completions here).
    Without the mode's other half, `torch.utils.deterministic.fill_uninitialized_memory` (every
    new tensor filled with NaN, a check for code that reads memory it never wrote): nothing here
    does, and on the demo's update those fills were ~14k calls, 2 % of its CPU time (perf), with
    the same weights to the bit without them (bench/demo_update.py's weights sha256).
    CUDA is left as it was (its deterministic mode needs cuBLAS set up before the device starts)."""
    if device.type != "cpu":
        yield
        return
    from torch.utils import deterministic

    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        deterministic.fill_uninitialized_memory = fill
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


SHORT_ATTENTION = 128
"""train.cpu_attention auto: the longest row (tokens) of a piece that runs SDPA's math kernel on a CPU.
Forward and backward of one layer's attention, bf16, one thread (2026-12-06, Intel Xeon with AMX):
math 15 against flash 24 ms at 16 x 64 tokens, 32 against 52 at 8 x 128; flash wins from 256
(26 against 64 ms at 4 x 256, 62 against 275 at 1 x 1024), and math keeps a T x T matrix a layer."""


@contextlib.contextmanager
def piece_attention(device: torch.device, choice: str, longest: int):
    """SDPA's math kernel inside, for a piece whose longest row is `longest` tokens, where
    train.cpu_attention (`choice`) is auto on a CPU and the rows are short; torch's choice otherwise.
    The forward picks the kernel, and its backward follows it."""
    if device.type != "cpu" or choice != "auto" or longest > SHORT_ATTENTION:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        yield
