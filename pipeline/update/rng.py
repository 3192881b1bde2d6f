"""The torch RNG an update draws from (LoRA dropout, train.lora.dropout): seeded from (seed,
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
