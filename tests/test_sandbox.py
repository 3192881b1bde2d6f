"""The code sandbox: correct code scores, and hostile code is contained, scores 0 and the call
returns normally. Which isolation applies is printed by `isolation()`; as root (this project's
machines) it is "namespaces", and the tests below hold for it."""

import os
import socket
import tempfile
from pathlib import Path

from pipeline.rewards import isolation, sandbox
from pipeline.rewards.sandbox import run_python

ADD = "def add(a, b):\n    return a + b\n"


def live_processes_with(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:  # exited while we looked
            pass
    return found


def test_correct_code_scores_one():
    result = run_python(ADD, ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"])
    assert (result.passed, result.total, result.status, result.score) == (2, 2, "ok", 1.0)


def test_a_failing_assert_does_not_stop_the_others():
    # Wrong for a >= 10: tests 1 and 3 fail, 0 and 2 pass -> 2/4.
    code = "def add(a, b):\n    return a + b if a < 10 else 0\nif __name__ == '__main__':\n    input()\n"
    tests = [
        "assert add(1, 2) == 3",
        "assert add(10, 2) == 12",
        "assert add(3, 4) == 7",
        "import sys; sys.exit(add(20, 1) != 21)",  # SystemExit fails the test, not the run
    ]
    result = run_python(code, tests)
    assert (result.passed, result.total, result.status, result.score) == (2, 4, "ok", 0.5)
    assert "test 1 failed (assert add(10, 2) == 12): AssertionError" in result.stderr_tail


def test_code_that_raises_runs_no_tests():
    result = run_python("def add(a, b:\n    pass", ["assert add(1, 2) == 3"])
    assert (result.passed, result.status) == (0, "error")
    assert "solution failed: SyntaxError" in result.stderr_tail


def test_printed_or_forged_results_do_not_count():
    # Writes a fake "test 0 passed" line to every descriptor it has, without the nonce.
    code = (
        "import os\n"
        "print('test 0 1'); print('done')\n"
        "for fd in os.listdir('/proc/self/fd'):\n"
        "    try:\n"
        "        os.write(int(fd), b'0123456789abcdef0123456789abcdef test 0 1\\n')\n"
        "    except OSError:\n"
        "        pass\n"
    )
    result = run_python(code, ["assert False"])
    assert (result.passed, result.status) == (0, "ok")


def test_an_infinite_loop_times_out_and_scores_zero():
    result = run_python("while True:\n    pass\n", ["assert True"], timeout_s=1.0)
    assert (result.passed, result.total, result.status, result.score) == (0, 1, "timeout", 0.0)


def test_tests_passed_before_a_hang_still_count():
    result = run_python(ADD, ["assert add(1, 2) == 3", "while True:\n    pass", "assert True"], timeout_s=1.0)
    assert (result.passed, result.total, result.status) == (1, 3, "timeout")


def test_a_fork_bomb_is_stopped_and_cleaned_up():
    # Each child leaves the process group (setsid) and replaces itself with a long sleep that
    # carries a marker we can look for in /proc. The bomb wants 200 children; the process
    # limit stops it near isolation.MAX_PROCS, and the uid sweep kills the escaped children.
    marker = f"grpo-fork-bomb-{os.getpid()}-{id(object())}"
    code = (
        "import os, sys\n"
        "children = []\n"
        "for _ in range(200):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        "        os.setsid()\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"
        "    children.append(pid)\n"
    )
    result = run_python(code, ["assert len(children) == 200"], timeout_s=5.0)
    assert (result.passed, result.score) == (0, 0.0)
    assert result.status == "ok"  # it gave up by itself: the limit, not the deadline, stopped it
    assert live_processes_with(marker) == []  # and nothing it started outlives the call


def test_a_huge_allocation_fails_inside_the_sandbox():
    result = run_python("data = bytearray(8 << 30)\n", ["assert len(data) == 8 << 30"], memory_mb=256)
    assert (result.passed, result.status) == (0, "error")
    assert "MemoryError" in result.stderr_tail
    result = run_python(ADD, ["x = [0] * (1 << 31)", "assert add(1, 1) == 2"], memory_mb=256)
    assert (result.passed, result.total, result.status) == (1, 2, "ok")


def test_files_outside_the_working_directory_are_not_written(tmp_path):
    target = tmp_path / "escaped.txt"
    code = (
        "import os\n"
        "open('inside.txt', 'w').write('fine')\n"  # its own directory is writable
        "try:\n"
        f"    open({str(target)!r}, 'w').write('pwned')\n"
        "except OSError:\n"
        "    pass\n"
    )
    tests = ["assert open('inside.txt').read() == 'fine'", f"assert open({str(target)!r}).read() == 'pwned'"]
    before = set(os.listdir(tempfile.gettempdir()))
    result = run_python(code, tests)
    assert (result.passed, result.total) == (1, 2)
    assert not target.exists()
    leftovers = {n for n in set(os.listdir(tempfile.gettempdir())) - before if n.startswith("grpo-sandbox-")}
    assert leftovers == set()  # the working directory is gone


def test_the_environment_is_scrubbed_and_the_directory_fresh(monkeypatch):
    monkeypatch.setenv("GRPO_TEST_SECRET", "hunter2")
    tests = ["import os; assert 'GRPO_TEST_SECRET' not in os.environ", "import os; assert os.listdir('.') == []"]
    assert run_python("", tests).score == 1.0


def test_the_network_is_unreachable_even_on_loopback():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        code = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'hello')\n"
            "    connected = True\n"
            "except OSError:\n"
            "    connected = False\n"
        )
        results = [run_python(code, ["assert connected"])]
        # The weakest fallback (a patched socket module, for machines without namespaces) too.
        results.append(sandbox._run("prelude", code, ["assert connected"], timeout_s=5.0, memory_mb=256, cpu_s=5))
        server.setblocking(False)
        try:
            server.accept()
            arrived = True
        except BlockingIOError:
            arrived = False
    assert [(r.passed, r.status) for r in results] == [(0, "ok"), (0, "ok")]
    assert not arrived


def test_as_root_the_code_runs_under_a_fresh_uid():
    if os.geteuid() != 0:
        assert sandbox.isolation() in ("userns", "prelude")
        return
    assert sandbox.isolation() == "namespaces"
    # Not root, and a closed directory holding the interpreter (/root for pyenv) shows nothing
    # but the way to the interpreter.
    tests = ["import os; assert os.getuid() != 0 and os.geteuid() != 0"]
    for directory, closed in isolation._hidden_interpreter_dirs():
        tests.append(f"import os; assert os.listdir({closed!r}) == [{Path(directory).relative_to(closed).parts[0]!r}]")
    result = run_python("", tests)
    assert (result.passed, result.total) == (len(tests), len(tests))
