"""Fault injection for the resume tests: a process that kills itself at a named point."""

from __future__ import annotations

import os
import signal


def fault_point(where: str, k: int) -> None:
    """Test hook for the resume tests: `GRPO_FAULT=<stage>:<point>[:<iteration>]` SIGKILLs this
    process when it reaches that point, so a test can die exactly between a part and its
    manifest. Points: `<stage>:part` (a part was just written), `<stage>:manifest` (every part
    is in, the manifest is not), `update:train` (trained, nothing saved), `update:publish`
    (policy k+1 written, or in `iterate` handed to its background write, the update manifest not),
    `update:record` (in that background write: policy k+1 hashed, the update manifest not written),
    `update:write` (in that background write: the update manifest and policy k+1's weights file
    written, its MANIFEST.json not), `update:state` (the trainer state that `iterate` writes at its end is saved, not yet
    moved into the run). Unset, it costs one environment lookup."""
    spec = os.environ.get("GRPO_FAULT", "").split(":")
    if len(spec) < 2:
        return
    stage, point, *iteration = spec
    if f"{stage}:{point}" == where and (not iteration or iteration[0] == str(k)):
        os.kill(os.getpid(), signal.SIGKILL)
