"""torchrun mode: each pytest process is one rank of a torchrun (or srun + torchrun) job.

The plugin (harness.plugin) switches to this mode when the launcher's environment is present
(:func:`launched`). Then there is no warm pool: one process group spans the job
(:mod:`.session`), each cell's implementation runs in-process on its rank and rank 0 gathers,
judges and shares the verdict (:mod:`.runner`), and a watchdog thread turns a hang into a failure
with every rank's stack, gathered through the store (:mod:`.watchdog`).
"""
from __future__ import annotations

import os

# What torchrun (torch.distributed.run) sets for every worker; RANK/WORLD_SIZE/LOCAL_RANK and the
# master address are the contract, TORCHELASTIC_RUN_ID tells torchrun apart from a hand-made env.
REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launched(environ=None) -> bool:
    """True when this process is a rank started by torchrun (or given the same environment)."""
    env = os.environ if environ is None else environ
    return all(env.get(name) for name in REQUIRED)
