"""Cases that need a real engine (DeepSpeed): slow, sharing one tiny model."""

from __future__ import annotations


def cases() -> list:
    return []
