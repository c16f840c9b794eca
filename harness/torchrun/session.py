"""One torchrun job seen from one rank: its environment, the store, the process group, the
collection check and the record of verdicts that survives torchrun's restarts.

Control traffic (collected ids, pieces, stacks, verdicts) goes through the launcher's TCPStore,
never through the process group: a hung or broken group must not stop rank 0 from learning what
happened. Under torchrun that store is hosted by the elastic agent (``TORCHELASTIC_USE_AGENT_STORE``)
and outlives the worker processes, so a restarted attempt finds the verdicts of the cells the
previous attempts judged and resumes after them.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..pool.backend import rank_device
from ..pool.backend import resolve as resolve_backend
from ..pool.groups import share_groups
from ..pool.wire import dumps
from ..world import World

# How long a rank waits for the others at a store rendezvous that is not a cell (collection,
# recovery): long enough for a loaded machine's slowest rank to import and collect.
SETUP_TIMEOUT = 300.0


class CollectionMismatch(RuntimeError):
    """Ranks collected different tests (or a different order): running on would deadlock."""


@dataclass(frozen=True)
class LaunchEnv:
    """What torchrun tells a worker about its place in the job."""

    rank: int
    world: int
    local_rank: int
    node_rank: int  # GROUP_RANK: which torchrun (host) started it
    master_addr: str
    master_port: int
    run_id: str
    attempt: int  # TORCHELASTIC_RESTART_COUNT: 0, then 1 after torchrun's first restart, ...
    agent_store: bool  # the elastic agent hosts the store (else rank 0 does)
    host: str
    per_host: int  # LOCAL_WORLD_SIZE: ranks torchrun started on this host

    @classmethod
    def from_env(cls, environ=None) -> "LaunchEnv":
        env = os.environ if environ is None else environ
        return cls(rank=int(env["RANK"]), world=int(env["WORLD_SIZE"]), local_rank=int(env["LOCAL_RANK"]),
                   node_rank=int(env.get("GROUP_RANK", 0)), master_addr=env["MASTER_ADDR"],
                   master_port=int(env["MASTER_PORT"]), run_id=env.get("TORCHELASTIC_RUN_ID", "none"),
                   attempt=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
                   agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True", host=socket.gethostname(),
                   per_host=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])))


class Session:
    """This rank's part of the job: the store, the process group over every rank, and the record."""

    def __init__(self, env: LaunchEnv, backend: str = "auto", deadline: float = 30.0):
        self.env = env
        self.rank, self.world = env.rank, env.world
        # NCCL where CUDA is present, one GPU per LOCAL_RANK (the same choice as the pool's ranks)
        self.backend = resolve_backend(backend)
        self.device = rank_device(self.backend, env.local_rank)
        self.deadline = deadline
        raw = dist.TCPStore(env.master_addr, env.master_port, env.world,
                            is_master=(env.rank == 0 and not env.agent_store),
                            timeout=timedelta(seconds=SETUP_TIMEOUT), wait_for_workers=False)
        self._raw = raw
        # keys of this torchrun invocation; the record (verdicts) is shared by its attempts, the rest
        # is per attempt so that a restart never reads a dead attempt's pieces as its own
        base = f"paritytest/{env.run_id}"
        self.record = dist.PrefixStore(f"{base}/record", raw)
        self.store = self.attempt_store(env.attempt)
        # The group gets a store connection of its own: its rendezvous (new_group, barriers) blocks in
        # store waits holding the connection, and the watchdog and SIGTERM threads must still be able
        # to write through ours. Its keys sit apart from ours and from torch's "default_pg" keys,
        # which a previous attempt may have left in the same (agent-hosted) store.
        pg_client = dist.TCPStore(env.master_addr, env.master_port, env.world, is_master=False,
                                  timeout=timedelta(seconds=SETUP_TIMEOUT), wait_for_workers=False)
        pg_store = dist.PrefixStore("pg", dist.PrefixStore(f"{base}/attempt{env.attempt}", pg_client))
        # A collective that never completes fails after the deadline (plus the time the watchdog
        # needs to gather stacks), not after torch's 30 minutes.
        timeout = timedelta(seconds=deadline + 60.0)
        # the job's world first (generation 0); each cell then runs in a world of its own size
        self.cell_world = World(env.rank, self.backend, pg_store, self.device, env.master_addr, env.master_port,
                                env.per_host, timeout)
        self.cell_world.enter(env.world, 0)
        share_groups()  # one group per rank set across the run's meshes, as in the pool's ranks
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        self.set(f"who/{env.rank}", {"host": env.host, "local_rank": env.local_rank, "node": env.node_rank,
                                     "pid": os.getpid()})

    # ---- the store --------------------------------------------------------------------------
    def set(self, key: str, value, store=None) -> None:
        (store or self.store).set(key, dumps(value))

    def get(self, key: str, store=None):
        return pickle.loads((store or self.store).get(key))

    def has(self, key: str, store=None) -> bool:
        return (store or self.store).check([key])

    def wait_all(self, keys: list[str], timeout: float, store=None) -> list[str]:
        """Poll until every key exists or ``timeout`` passes; returns the keys still missing."""
        store = store or self.store
        end = time.monotonic() + timeout
        missing = list(keys)
        while missing:
            missing = [k for k in missing if not store.check([k])]
            if not missing or time.monotonic() > end:
                break
            time.sleep(0.02)
        return missing

    def who(self, attempt: int | None = None) -> dict[int, dict]:
        """Host, local rank, node and pid of every rank of an attempt (this one by default)."""
        store = self.store if attempt is None else self.attempt_store(attempt)
        return {r: self.get(f"who/{r}", store) for r in range(self.world) if self.has(f"who/{r}", store)}

    def attempt_store(self, attempt: int):
        """The keys of one attempt (torchrun's restart count) of this job."""
        return dist.PrefixStore(f"paritytest/{self.env.run_id}/attempt{attempt}", self._raw)

    # ---- the collection check ---------------------------------------------------------------
    def check_collection(self, nodeids: list[str]) -> None:
        """Every rank must have collected the same tests in the same order, or the first cell that
        differs would leave the others waiting in a collective forever. Each rank publishes its
        ordered ids; every rank compares every rank's digest with rank 0's and, on a difference,
        raises naming the first differing id (so all ranks stop, none waits)."""
        digest = hashlib.sha256("\n".join(nodeids).encode()).hexdigest()
        self.set(f"collect/{self.rank}", (digest, nodeids))
        keys = [f"collect/{r}" for r in range(self.world)]
        missing = self.wait_all(keys, SETUP_TIMEOUT)
        if missing:
            ranks = sorted(int(k.rsplit("/", 1)[1]) for k in missing)
            raise CollectionMismatch(f"ranks {ranks} did not finish collecting within {SETUP_TIMEOUT:g} s "
                                     "(did their pytest fail to start? see their output)")
        first, first_ids = self.get("collect/0")
        for r in range(1, self.world):
            theirs, their_ids = self.get(f"collect/{r}")
            if theirs == first:
                continue
            at = next((i for i, (a, b) in enumerate(zip(first_ids, their_ids)) if a != b),
                      min(len(first_ids), len(their_ids)))
            mine = first_ids[at] if at < len(first_ids) else "(nothing: rank 0's list ends here)"
            other = their_ids[at] if at < len(their_ids) else f"(nothing: rank {r}'s list ends here)"
            raise CollectionMismatch(
                f"torchrun ranks collected different tests: rank 0 has {len(first_ids)}, rank {r} has "
                f"{len(their_ids)}; the first difference is test #{at + 1}: rank 0 has {mine}, rank {r} has "
                f"{other}. Every rank must select the same tests in the same order (same paths, -k, -m, "
                "conftests and installed extras on every host)")
