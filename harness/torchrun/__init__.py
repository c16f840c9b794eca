"""torchrun mode: each pytest process is one rank of a torchrun (or srun + torchrun) job.

The plugin (harness.plugin) switches to this mode when the launcher's environment is present
(``harness.plugin.launched_by_torchrun``, kept there so that a pool run never imports this
package). Then there is no warm pool: one process group spans the job (:mod:`.session`), each
cell's implementation runs in-process on its rank and rank 0 gathers, judges and shares the verdict
(:mod:`.runner`), and a watchdog thread turns a hang into a failure with every rank's stack,
gathered through the store (:mod:`.watchdog`).
"""
