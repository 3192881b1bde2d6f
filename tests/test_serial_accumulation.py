"""The update's deterministic mode on a CPU (pipeline/update/determinism.py): torch's
deterministic kernels inside, without the mode's NaN fill of every new tensor, both put back
afterwards."""

import torch
from torch.utils import deterministic

from pipeline.update.determinism import serial_accumulation


def test_deterministic_kernels_without_the_nan_fill_inside_and_restored_after():
    before = torch.are_deterministic_algorithms_enabled(), deterministic.fill_uninitialized_memory
    assert before == (False, True)  # torch's defaults in a test process
    with serial_accumulation(torch.device("cpu")):
        assert torch.are_deterministic_algorithms_enabled()
        assert deterministic.fill_uninitialized_memory is False
        # the deterministic index_put with accumulate (what the shared KV cache's backward uses) still adds in order
        x = torch.zeros(3).index_put((torch.tensor([0, 0, 2]),), torch.tensor([1.0, 2.0, 4.0]), accumulate=True)
        assert x.tolist() == [3.0, 0.0, 4.0]
    assert (torch.are_deterministic_algorithms_enabled(), deterministic.fill_uninitialized_memory) == before


def test_the_fill_setting_comes_back_after_an_error():
    try:
        with serial_accumulation(torch.device("cpu")):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert deterministic.fill_uninitialized_memory is True
    assert not torch.are_deterministic_algorithms_enabled()
