"""Under a failing model cell's table: the first diverging module, from a re-run with the module
hooks recording (:mod:`harness.model.hooks`), compared by bisect's localisation."""
from __future__ import annotations

import re

from ..config import Config


def module_of(key: str) -> str:
    """``"bwd module microbatch=0 module=layers.1.mlp step=1 #2"`` -> ``"backward of layers.1.mlp (step 1, microbatch 0)"``."""
    where = dict(re.findall(r"(\w+)=(\S+)", key))
    phase = "output" if key.startswith("fwd") else "input gradient"
    return f"{where.get('module', '?')} ({phase}, step {where.get('step', '?')}, microbatch {where.get('microbatch', '?')})"


def explain(cfg: Config, pool) -> str:
    """Re-run ``cfg`` with every module's events recorded, in the pool and in the reference; name the
    first module whose output (forward) or input gradient (backward) diverges, and say whether its
    inputs still matched. Empty under torchrun (the other ranks run each cell once)."""
    from ..bisect.localise import localise
    from ..pool.parent import Pool

    if not isinstance(pool, Pool):
        return ""
    found = localise(cfg, pool)
    lines = []
    if found.origin is not None:
        lines.append(f"first diverging module: {module_of(found.origin.key)}: its inputs still match the "
                     "reference, its outputs do not")
    elif found.first_diverging is not None:
        lines.append(f"first diverging module: {module_of(found.first_diverging.key)}; its inputs already differ "
                     "(the divergence starts in code no module hook sees)")
    else:
        lines.append("first diverging module: none: every module's outputs and input gradients match the reference, "
                     "so the divergence is in the gradient reduction, the optimizer step or the loss reduction")
    lines.append(found.summary())
    return "\n".join(lines)
