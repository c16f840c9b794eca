"""The warm pool: rank processes forked once from a zygote that imported torch, joined in one
process group, and sent one task at a time under a deadline.

* :mod:`.parent`: :class:`Pool` in the pytest (or bisect) process: start, run a task, gather every
  rank's outcome, kill and restart on a hang or a death;
* :mod:`.rank`: the zygote and the rank loop, on the other side;
* :mod:`.kept`, :mod:`.keeper`: the keepers the zygotes are forked from (a process's own, or a kept one);
* :mod:`.backend`: gloo or NCCL, and each rank's device;
* :mod:`.tasks`: small tasks the harness itself sends (the empty case, mesh checks);
* :mod:`.state`: what a cell's code can leave changed in its process, checked after every task.
"""
_PARENT = ("CaseFailure", "LeftChanged", "Pool", "PoolError", "shared_pool")


def __getattr__(name: str):
    """The parent side's names, imported on first use: the keeper (:mod:`.keeper`) listens before
    it imports torch, which :mod:`.parent` does."""
    if name in _PARENT:
        from . import parent

        return getattr(parent, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
