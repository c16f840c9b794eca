"""What a task and its result travel as between processes: pickle, with CPU tensors as raw bytes.

Pickle sends a tensor's storage through ``torch.save`` and reads it back with ``torch.load``, about
a millisecond a dict of small tensors each way, and a cell's ranks send thousands of them. Here a
plain CPU tensor goes as its dtype, shape and bytes (a tenth of that); anything else (a tensor on
a device, needing a gradient, a subclass such as DTensor or Parameter, sparse, quantized, with a
conj or neg bit) keeps pickle's own way. Read with ``pickle.loads``.
"""
from __future__ import annotations

import copyreg
import io
import pickle

import torch


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], data: bytes) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def _reduce(t: torch.Tensor):
    if t.device.type != "cpu" or t.layout != torch.strided or t.requires_grad or t.is_quantized \
            or t.is_conj() or t.is_neg():
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    return _tensor, (t.dtype, tuple(t.shape), t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


class _Pickler(pickle.Pickler):
    dispatch_table = copyreg.dispatch_table.copy()
    dispatch_table[torch.Tensor] = _reduce  # exact type: subclasses keep their own reduction


def dumps(obj) -> bytes:
    """``obj`` pickled at the highest protocol, plain CPU tensors as raw bytes."""
    out = io.BytesIO()
    _Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return out.getvalue()
