"""Parallel implementations of each component, on torch.distributed primitives."""
