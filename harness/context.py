"""What a parallel implementation sees on its rank: its mesh, groups, device, and seeds."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from .layout import MeshLayout


def derive_seed(*parts) -> int:
    """A 63-bit seed determined by ``parts`` alone: the same in every process, on every platform."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def generator(*parts) -> torch.Generator:
    """A private CPU generator seeded from ``parts`` (never the shared global generator)."""
    return torch.Generator().manual_seed(derive_seed(*parts))


def _dims(dims) -> tuple[tuple[str, int], ...]:
    if isinstance(dims, str):
        from .matrix import mesh

        return mesh(dims)
    return tuple((str(n), int(d)) for n, d in dims)


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
    # Further meshes over the first ranks of the same world, declared by the component for this
    # config (``Component.meshes``), keyed by their :class:`harness.layout.MeshDeclaration`: a
    # DeviceMesh under its MeshLayout (the layout a checkpoint is loaded under), a model's dense,
    # sparse and flattened meshes under its MeshSpec.
    declared: dict = field(default_factory=dict)

    def mesh(self, dims) -> "torch.distributed.device_mesh.DeviceMesh":
        """The cell's mesh, or a declared extra mesh by its dims (tuple of pairs or ``"dp=2,ep=2"``)."""
        key = MeshLayout.of(_dims(dims))
        if key.dims == self.layout.dims:
            return self.device_mesh
        return self._declared(key)

    def meshes_for(self, spec) -> "harness.meshes.device_mesh.Meshes":
        """The meshes of a declared :class:`harness.meshes.MeshSpec` on this rank."""
        return self._declared(spec)

    def _declared(self, mesh):
        try:
            return self.declared[mesh]
        except KeyError:
            raise KeyError(f"mesh {mesh.id} was not declared for this config; declared: "
                           f"{sorted(m.id for m in self.declared) or 'none'}; return it from the component's "
                           "meshes(cfg)") from None

    def group(self, name: str):
        """Process group of this rank's line along mesh dim ``name``."""
        return self.device_mesh.get_group(name)

    def coord(self, name: str) -> int:
        """This rank's coordinate along mesh dim ``name`` (0 when the mesh has no such dim)."""
        return self.layout.coord(self.rank, name) if name in self.layout.names else 0

    def degree(self, name: str) -> int:
        """Size of mesh dim ``name`` (1 when the mesh has no such dim)."""
        return self.layout.shape[self.layout.names.index(name)] if name in self.layout.names else 1
