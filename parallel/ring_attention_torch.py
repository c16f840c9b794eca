"""Placeholder: torch context_parallel implementation (written below)."""


def skip_reason(cfg):
    return "not written yet"


def run(ctx, cfg):
    raise NotImplementedError
