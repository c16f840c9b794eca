"""Tensor parallelism through PyTorch's DTensor API (placeholder until written)."""


def skip_reason(cfg):
    return "DTensor implementation not written yet"


def run(ctx, cfg):
    raise NotImplementedError
