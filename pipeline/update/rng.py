"""Each rank's torch RNG, kept with the trainer state (as TRL keeps rng_state.pth in a checkpoint).

LoRA dropout (train.lora.dropout) draws from it during the update. The trainer seeds it once when
it starts, and a warm trainer (`iterate`) carries it from update to update; an update resumed or
re-run from a state (train.state_every) must draw what the uninterrupted run drew, so the state
carries it. A state written before it did resumes from the seed, as it did then.
"""

from __future__ import annotations

from pathlib import Path

import torch

RNG = "rng-rank{rank}.pt"


def save_rng(out: Path, rank: int) -> None:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    torch.save({"cpu": torch.get_rng_state(), "cuda": cuda}, out / RNG.format(rank=rank))


def load_rng(src: Path, rank: int) -> None:
    path = src / RNG.format(rank=rank)
    if not path.exists():
        return
    state = torch.load(path, weights_only=True)
    torch.set_rng_state(state["cpu"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
