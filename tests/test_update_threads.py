"""The update's thread count on a CPU (pipeline/update/threads.py): one thread unless
OMP_NUM_THREADS says otherwise, set even where an in-process vLLM engine has made
torch.set_num_threads a no-op, and put back afterwards."""

import torch

from pipeline.update.threads import threads_for, update_threads

CPU = torch.device("cpu")


def test_one_thread_inside_without_omp_num_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    torch._C.set_num_threads(2)  # torch.set_num_threads may be vLLM's no-op already (an engine earlier in this worker)
    try:
        # what vLLM's CPU worker does to torch in its process (vllm/v1/worker/cpu_worker.py)
        monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
        assert threads_for(CPU) == 1
        with update_threads(CPU):
            assert torch.get_num_threads() == 1
            x = torch.randn(64, 64, requires_grad=True)
            (x @ x).sum().backward()  # autograd on a CPU runs on the calling thread: the same setting
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch._C.set_num_threads(before)


def test_omp_num_threads_and_gpus_are_left_alone(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert threads_for(CPU) is None
    before = torch.get_num_threads()
    with update_threads(CPU):
        assert torch.get_num_threads() == before
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert threads_for(torch.device("cuda", 0)) is None
