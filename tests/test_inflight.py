"""The in-flight write when its thread cannot start (pipeline/run/inflight.py, record.py's step 1)."""

import threading

import pytest

from pipeline.run import inflight


def test_a_write_whose_thread_never_starts_leaves_nothing_in_flight(tmp_path, monkeypatch):
    (tmp_path / "policy").mkdir()
    ran = []

    def refuse(self):
        raise RuntimeError("can't start new thread")  # what threading raises out of threads

    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        inflight.start(str(tmp_path), 1, ran.append)
    monkeypatch.undo()
    assert ran == [] and inflight.get(str(tmp_path), 1) is None
    assert inflight.settle(str(tmp_path), None, "files") is None  # at once: no reader waits on a thread that never ran
    w = inflight.start(str(tmp_path), 1, lambda p: p.record("h"))  # the next write of the run starts as usual
    assert inflight.settle(str(tmp_path), 1, "files") == "h" and w.thread is not None
