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


def first_gradients(cfg: Config, report, most: int = 3) -> str:
    """The parameters whose step-1 gradient diverges, in the order backward computes them (the last
    module's first), each with its module and what is wrong; "" when every gradient matches."""
    from reference.common import grad_name

    from .batches import start_model
    from .register import case_of

    failing = {row.tensor: row for row in report.failing()}
    names = [n for n, _ in start_model(case_of(cfg.component), cfg).named_parameters()]
    bad = [(n, failing[grad_name(n)]) for n in reversed(names) if grad_name(n) in failing]
    if not bad:
        return ""
    shown = [f"{n} (module {n.rpartition('.')[0] or n}: {row.problem}, norm ratio {row.norm_ratio:.4g}"
             + (f", ranks {row.ranks}" if row.ranks else "") + ")" for n, row in bad[:most]]
    more = f", and {len(bad) - most} more" if len(bad) > most else ""
    return f"first diverging parameter gradients (step 1, in backward order): {'; '.join(shown)}{more}"


def explain(cfg: Config, pool, report) -> str:
    """Re-run ``cfg`` with every module's events recorded, in the pool and in the reference; name the
    first module whose output (forward) or input gradient (backward) diverges, and say whether its
    inputs still matched; then the first parameter gradients that diverge (``report``, the cell's
    comparison). The re-run is left out under torchrun (the other ranks run each cell once)."""
    from ..bisect.localise import localise
    from ..pool.parent import Pool

    gradients = first_gradients(cfg, report)
    if not isinstance(pool, Pool):
        return gradients
    found = localise(cfg, pool)
    lines = []
    first = found.first_diverging
    if first is not None and first.starts_here:
        lines.append(f"first diverging module: {module_of(first.key)}: its inputs still match the reference, "
                     "its outputs do not")
    elif first is not None:
        before = f" after {module_of(found.last_matching)}" if found.last_matching else ""
        lines.append(f"first diverging module: {module_of(first.key)}; what it received already differs: the "
                     f"divergence starts{before} in code no module hook sees (between modules, the loss, a hook)")
    elif found.compared == 0:
        lines.append("first diverging module: not known: no module's tensors could be placed on the mesh to compare "
                     "(a pipeline's microbatches are not slices of the global batch)")
    else:
        lines.append("first diverging module: none: every module's outputs and input gradients match the reference, "
                     "so the divergence is in the gradient reduction, the optimizer step or the loss reduction")
    lines.append(found.summary())
    return "\n".join(lines + ([gradients] if gradients else []))
