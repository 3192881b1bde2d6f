"""What a person sees: progress lines that keep the iteration table readable, and third-party
chatter captured unless something fails."""

from __future__ import annotations

import os

import pytest

from pipeline import progress as progress_mod
from pipeline.quiet import captured


def test_plain_progress_is_silent_for_short_loops_and_periodic_for_long_ones(monkeypatch, capsys):
    clock = iter([0.0, 1.0, 2.0, 3.0])  # start, then one tick per advance
    monkeypatch.setattr(progress_mod.time, "time", lambda: next(clock))
    with progress_mod.progress("rollout iteration 0 parts", 3) as bar:
        for _ in range(3):
            bar.advance()
    assert capsys.readouterr().err == ""  # 3 s in all: nothing between the table's rows

    clock = iter([0.0, 4.0, 11.0, 15.0, 23.0])
    monkeypatch.setattr(progress_mod.time, "time", lambda: next(clock))
    with progress_mod.progress("update iteration 0 optimizer steps", 4) as bar:
        for _ in range(4):
            bar.advance()
    assert capsys.readouterr().err.splitlines() == [
        "update iteration 0 optimizer steps: 2/4 (11s)",  # 10 s since the start
        "update iteration 0 optimizer steps: 4/4 (23s)",  # the end, since a line was printed
    ]


def test_captured_hides_file_descriptor_output_unless_the_block_fails(capfd, monkeypatch):
    monkeypatch.delenv("GRPO_VERBOSE", raising=False)
    with captured():
        os.write(2, b"NUMA binding: a C++ warning\n")  # below Python, as vLLM's C++ writes it
        os.write(1, b"DeepSpeed op built successfully\n")
    out, err = capfd.readouterr()
    assert out == "" and err == ""

    with pytest.raises(RuntimeError, match="engine failed"):
        with captured():
            os.write(2, b"the library's own explanation\n")
            raise RuntimeError("engine failed")
    assert "the library's own explanation" in capfd.readouterr().err

    monkeypatch.setenv("GRPO_VERBOSE", "1")
    with captured():
        os.write(2, b"shown when asked\n")
    assert capfd.readouterr().err == "shown when asked\n"


@pytest.mark.slow
def test_ctrl_c_in_iterate_says_how_to_go_on_and_the_rerun_finishes(make_run):
    """Ctrl-C (SIGINT to the command's process group, as a terminal sends it) in iteration 1's vLLM
    rollout, between its parts: the trainer has joined vLLM's process group by then (iteration 0's
    update), the case where vLLM's own teardown printed a stray "Invalid process group" traceback
    line. Exit 130 with one line saying what to do, no traceback line on either stream, no
    partial part, the run's locks released, and the same command, run again, finishes the run."""
    import signal
    import subprocess
    import sys
    import time

    import pyarrow.parquet as pq

    from conftest import REPO, grpo
    from pipeline.run.run import Run

    path = make_run("interrupted", rollout={"engine": "vllm", "prompts_per_iter": 4, "groups_per_part": 1, "max_new_tokens": 48})
    proc = subprocess.Popen([sys.executable, "-m", "stages.cli", "iterate", path, "--iters", "2"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 600
    rollout = os.path.join(path, "iter-0001", "rollout")
    first = os.path.join(rollout, "part-00000.parquet")
    while not os.path.exists(first) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)  # iteration 1's first part is in: the rollout is generating the next one
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert err.splitlines()[-1] == "interrupted; rerun the same command to resume"
    for stream in (out, err):
        assert "Traceback" not in stream and "Invalid process group" not in stream, stream[-3000:]
    assert not os.path.exists(os.path.join(rollout, "MANIFEST.json"))  # stopped mid-rollout
    assert not [f for _, _, files in os.walk(path) for f in files if f.startswith(".tmp")]  # nothing half-written
    for name in os.listdir(rollout):
        if name.endswith(".parquet"):
            assert pq.read_table(os.path.join(rollout, name)).num_rows == 4  # a part is whole or absent
    rerun = grpo("iterate", path, "--iters", "2", timeout=900)  # would wait on a held lock, then fail
    assert Run(path).completed_iters() == 2, rerun.stderr[-2000:]


def test_ctrl_c_then_a_failed_background_write_exits_as_ctrl_c_with_both_lines(make_run, capsys):
    """Ctrl-C in `iterate` unwinds through WarmEngines.close, which waits for the background write of
    the newest policy; when that write failed too, its one line is printed and the command still
    ends as a Ctrl-C (exit 130, what to do next), not as the write's error (exit 1)."""
    from pipeline.loop.iteration import WarmEngines
    from pipeline.run.run import Run
    from pipeline.run import inflight
    from stages.cli import app, run_cli

    run = Run(make_run("interrupted"))

    def write(p) -> None:
        raise OSError(28, "No space left on device")

    def interrupted_while_writing() -> None:
        warm = WarmEngines(run)
        inflight.start(run.store.root, 1, write)
        try:
            raise KeyboardInterrupt  # what SIGINT raises in the loop
        finally:
            warm.close()

    app.command("interrupted-while-writing")(interrupted_while_writing)
    try:
        code = run_cli(["interrupted-while-writing"])
    finally:
        app.registered_commands.pop()
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert code == 130
    assert lines == [f"error: {os.path.realpath(run.store.root)}/policy/iter-0001: its background write failed: OSError: [Errno 28] No space left on device",
                     "interrupted; rerun the same command to resume"]
