"""torchrun mode: each pytest process is one rank of a torchrun (or srun + torchrun) job.

The plugin (harness.plugin) registers this mode's own (:mod:`.plugin`) when the launcher's
environment is present. Then there is no warm pool: one process group spans the job
(:mod:`.session`), each cell's implementation runs in-process on its rank and rank 0 gathers, judges
and shares the verdict (:mod:`.runner`), and a watchdog thread turns a hang into a failure with
every rank's stack, gathered through the store (:mod:`.watchdog`). A pool run imports
:mod:`.plugin` alone, which imports nothing else of this package until torchrun mode starts.
"""
