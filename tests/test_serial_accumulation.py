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


def _kernels(out: torch.Tensor) -> set[str]:
    """The autograd nodes behind `out`: which SDPA kernel its forward ran."""
    seen, todo = set(), [out.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn.name() in seen:
            continue
        seen.add(fn.name())
        todo += [f for f, _ in fn.next_functions]
    return seen


def test_short_pieces_run_sdpa_math_on_a_cpu_and_the_rest_torch_choice_with_the_same_gradients():
    """train.cpu_attention auto: a piece of rows up to SHORT_ATTENTION tokens runs SDPA's math kernel
    (no flash node in its graph), a longer one and `sdpa` keep torch's flash kernel; the math
    kernel's values and gradients equal flash's to fp32 rounding."""
    import torch.nn.functional as F

    from pipeline.update.determinism import SHORT_ATTENTION, piece_attention

    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 40, 16, generator=g, requires_grad=True) for _ in range(3))
    outs, grads = {}, {}
    for name, choice, longest in (("math", "auto", 40), ("long", "auto", SHORT_ATTENTION + 1), ("sdpa", "sdpa", 40)):
        with piece_attention(cpu, choice, longest):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        flash = any("Flash" in n for n in _kernels(o))
        assert flash == (name != "math"), (name, _kernels(o))
        outs[name] = o.detach()
        grads[name] = torch.autograd.grad(o.square().sum(), (q, k, v))
    assert torch.allclose(outs["math"], outs["sdpa"], atol=1e-5)
    for a, b in zip(grads["math"], grads["sdpa"]):
        assert torch.allclose(a, b, atol=1e-4)
    with piece_attention(torch.device("cuda"), "auto", 40):  # a GPU's update: torch's choice (the tensors here stay on the CPU)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert any("Flash" in n for n in _kernels(o))
