"""What a parallel implementation sees on its rank: its mesh, groups, device, and seeds."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from .layout import MeshLayout


def derive_seed(*parts) -> int:
    """A 63-bit seed determined by ``parts`` alone: the same in every process, on every platform."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def generator(*parts) -> torch.Generator:
    """A private CPU generator seeded from ``parts`` (never the shared global generator)."""
    return torch.Generator().manual_seed(derive_seed(*parts))


@dataclass
class RankContext:
    """Handed to an implementation's ``run(ctx, cfg)`` on every rank of the case's mesh."""

    rank: int
    layout: MeshLayout
    device_mesh: "torch.distributed.device_mesh.DeviceMesh"
    device: torch.device
    backend: str
    # A directory every rank of this task sees, empty at the start and removed by the parent after
    # the task, whether it passed, failed or hung (checkpoints and other files a case writes).
    scratch: str = ""

    def group(self, name: str):
        """Process group of this rank's line along mesh dim ``name``."""
        return self.device_mesh.get_group(name)

    def coord(self, name: str) -> int:
        """This rank's coordinate along mesh dim ``name`` (0 when the mesh has no such dim)."""
        return self.layout.coord(self.rank, name) if name in self.layout.names else 0

    def degree(self, name: str) -> int:
        """Size of mesh dim ``name`` (1 when the mesh has no such dim)."""
        return self.layout.shape[self.layout.names.index(name)] if name in self.layout.names else 1
