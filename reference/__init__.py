"""Single-process references: plain PyTorch, no torch.distributed at all."""
