"""FSDP2 (``fully_shard``) as the second fsdp implementation: not wired yet, its cells skip."""
from __future__ import annotations

from harness.config import Config


def skip_reason(cfg: Config) -> str | None:
    return "the FSDP2 implementation is not wired yet"


def run(ctx, cfg: Config):
    raise NotImplementedError("FSDP2 fsdp implementation")
