"""Golden files: one small safetensors file per cell, loadable without running code.

Tensors keep their dtype (bf16 stays exact). Metadata is one JSON string with sorted keys, so the
bytes are a function of the values and the metadata alone. Files are written to a temporary name
and renamed into place: a crash never leaves half a golden file.
"""
from __future__ import annotations

import json
import os
import platform
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import Config

if TYPE_CHECKING:
    import torch

META_KEY = "harness"


class GoldenError(Exception):
    """A golden file that is missing, unreadable, or belongs to another config."""


def golden_path(root: Path, cfg: Config) -> Path:
    return Path(root) / cfg.component / f"{cfg.id}.safetensors"


def update_command(rerun: str) -> str:
    """The command that rewrites a cell's golden file, from the command that reruns the cell."""
    return f"{rerun or 'python -m pytest <the cell>'} --update-golden"


def metadata(cfg: Config, tolerance: str, backend: str) -> dict[str, str]:
    import torch

    return {
        "config": cfg.id,
        "torch": torch.__version__,
        "platform": f"{platform.system()}-{platform.machine()}",
        "backend": backend,
        "tolerance": tolerance,
    }


def write_golden(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    from safetensors.torch import save

    data = save({k: t.detach().cpu().contiguous() for k, t in sorted(tensors.items())},
                metadata={META_KEY: json.dumps(meta, sort_keys=True)})
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


class MissingGolden(GoldenError):
    """A cell that has no golden file yet."""


def read_golden(path: Path, cfg: Config, rerun: str = "") -> tuple[dict[str, torch.Tensor], dict]:
    """Tensors and metadata of ``cfg``'s golden file, or a :class:`GoldenError` that says what to do.

    ``rerun``: the command that reruns the cell, quoted in the fix.
    """
    from safetensors import safe_open

    fix = update_command(rerun)
    if not path.exists():
        raise MissingGolden(f"golden file {path} is missing: create it with\n  {fix}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})[META_KEY])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as error:  # noqa: BLE001  any loader failure means the same thing to the user
        raise GoldenError(
            f"golden file {path} is corrupt or truncated ({type(error).__name__}: {error}); "
            f"delete it and recreate it with\n  {fix}"
        ) from None
    if meta.get("config") != cfg.id:
        raise GoldenError(f"golden file {path} holds config {meta.get('config')!r}, not {cfg.id!r}; "
                          f"recreate it with\n  {fix}")
    return tensors, meta

