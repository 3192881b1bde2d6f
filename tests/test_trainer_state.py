"""The trainer state carries what the next update draws: a trainer resumed from a state steps as
the warm trainer that wrote it would have.

LoRA dropout draws from torch's RNG during the update. A warm trainer (`iterate`) carries the RNG
from update to update; a trainer resumed from a state (a new command, or a re-run of the updates
after a state under train.state_every) seeded it afresh, so its next update drew other dropout
masks: a resumed run was not the uninterrupted one, and a re-run from a state written mid-command
did not reproduce the recorded policy hash. The state keeps each rank's RNG (pipeline.update.rng).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from test_publish_master import _one_step

pytestmark = pytest.mark.slow


def _adapter(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.engine.module.named_parameters() if p.requires_grad}


def test_a_trainer_resumed_from_a_state_draws_the_warm_trainers_dropout(assets, tmp_path):
    from pipeline import config as config_mod
    from pipeline.update.trainer import Trainer
    from tests.conftest import base_config

    cfg = config_mod.resolve(base_config(assets, train={"lr": 1e-2, "lora": {"r": 4, "alpha": 8, "dropout": 0.5}}))
    model = Path(assets["model"])
    warm = Trainer(cfg, model, None, base_dir=model)
    try:
        _one_step(warm)  # the RNG moves past the seed, as after an earlier update of the same command
        warm.save_state(tmp_path / "state")
        before = _adapter(warm)
        _one_step(warm)
        after_warm = _adapter(warm)
    finally:
        warm.close()
    resumed = Trainer(cfg, model, tmp_path / "state", base_dir=model)
    try:
        assert all(torch.equal(before[n], t) for n, t in _adapter(resumed).items())  # the state's weights
        _one_step(resumed)
        after_resumed = _adapter(resumed)
    finally:
        resumed.close()
    assert any(not torch.equal(before[n], after_warm[n]) for n in before)  # the step moved the adapter
    assert all(torch.equal(after_warm[n], after_resumed[n]) for n in after_warm), "the resumed step drew other dropout masks"
