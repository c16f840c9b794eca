"""Checks of real mesh groups against the model (:class:`harness.meshes.device_mesh.MeshSpec`) and of the
properties any layout must have, whoever built it.

Each check returns a list of messages (empty: it holds); a message names the layout, the rank and
the group, so a failing test says where a rank map went wrong.
"""
from __future__ import annotations

from ..names import FLATTENED, GROUPS
from .device_mesh import MeshSpec


def check_rank(spec: MeshSpec, rank: int, seen: dict) -> list[str]:
    """One rank's coordinates and named groups (``Meshes.describe()``) against the model."""
    errors = []
    model = spec.coords(rank)
    for which in ("dense", "sparse"):
        if tuple(seen[which]) != model[which]:
            errors.append(f"{spec.id}: rank {rank} has {which} coordinates {tuple(seen[which])}, "
                          f"the model {model[which]}")
    for name, got in seen["groups"].items():
        want = spec.group_of(rank, name.split(".")[-1])
        if list(got) != want:
            errors.append(f"{spec.id}: rank {rank}'s {name} group is {list(got)}, the model's {want}")
    return errors


def check_partition(world: int, by_rank: dict[int, dict[str, list[int]]], label: str = "") -> list[str]:
    """Groups of one name partition the world: each rank is in its own group, and every member of a
    group reports that same group."""
    errors = []
    missing = sorted(set(range(world)) - set(by_rank))
    if missing:
        return [f"{label}: ranks {missing} reported no groups"]
    names = sorted(by_rank[0])
    for name in names:
        for rank in range(world):
            group = list(by_rank[rank][name])
            if rank not in group:
                errors.append(f"{label}: rank {rank}'s {name} group {group} does not hold rank {rank}")
                continue
            for member in group:
                if not 0 <= member < world:
                    errors.append(f"{label}: rank {rank}'s {name} group {group} holds rank {member}, "
                                  f"outside the world of {world}")
                elif list(by_rank[member][name]) != group:
                    errors.append(f"{label}: rank {rank}'s {name} group is {group} but rank {member}'s "
                                  f"is {list(by_rank[member][name])}")
    return errors


def check_borrowing(spec: MeshSpec, by_rank: dict[int, dict[str, list[int]]], ranks=None) -> list[str]:
    """The sparse groups against the dense groups they borrow from, on the groups as seen (not the
    model): the sparse mesh's pp and rep are the dense ones; ep lies inside the dims it
    borrows; etp is tp when etp = tp; the expert block efsdp·ep·etp is the dense dp·cp·tp block;
    each flattened group is the product of the dims it merges. ``ranks``: the ranks to check (all)."""
    errors = []
    lender, _ = spec.lender()
    for rank in sorted(by_rank) if ranks is None else ranks:
        g = by_rank[rank]
        def union(name, ranks):
            return set().union(*(set(by_rank[r][name]) for r in ranks))

        for dim in ("pp", "rep"):
            if f"sparse.{dim}" in g and list(g[f"sparse.{dim}"]) != list(g[dim]):
                errors.append(f"{spec.id}: rank {rank}'s sparse {dim} group {list(g[f'sparse.{dim}'])} "
                              f"is not its dense {dim} group {list(g[dim])}")
        dense_block = union("tp", g["fsdp"])
        sparse_block = union("etp", union("ep", g["efsdp"]))
        if dense_block != sparse_block:
            errors.append(f"{spec.id}: rank {rank}'s expert block efsdp·ep·etp {sorted(sparse_block)} is not "
                          f"its dense block dp·cp·tp {sorted(dense_block)}")
        lent = set(g["fsdp"]) if lender == ("dp", "cp") else dense_block
        if not set(g["ep"]) <= lent:
            errors.append(f"{spec.id}: rank {rank}'s ep group {list(g['ep'])} is not inside its "
                          f"{'·'.join(lender)} group {sorted(lent)}, the dims ep borrows from")
        if spec.etp == spec.tp and list(g["etp"]) != list(g["tp"]):
            errors.append(f"{spec.id}: rank {rank}'s etp group {list(g['etp'])} is not its tp group {list(g['tp'])}")
        for name, dims in FLATTENED.items():
            inner = {rank}
            for dim in dims:
                inner = union(dim, inner)
            if inner != set(g[name]):
                errors.append(f"{spec.id}: rank {rank}'s {name} group {list(g[name])} is not the product of its "
                              f"{'·'.join(dims)} groups {sorted(inner)}")
    return errors


def check_all_groups(spec: MeshSpec, partitions: dict[str, list[list[int]]]) -> list[str]:
    """Every group of every name as the real meshes enumerate them against the model's."""
    errors = []
    for name in GROUPS:
        got, want = sorted(map(list, partitions[name])), sorted(spec.groups(name))
        if got != want:
            extra = [g for g in got if g not in want][:3]
            lost = [g for g in want if g not in got][:3]
            errors.append(f"{spec.id}: the {name} groups differ from the model's: torch has {extra}..., "
                          f"the model {lost}...")
    return errors


def check_comm_map(comm_map: dict[str, list[tuple[int, int]]], groups: dict[int, dict[str, list[int]]],
                   claim: str) -> list[str]:
    """A hand-written map of rank pairs per dim against the groups of the layout it claims.

    ``comm_map[dim]``: pairs ``(a, b)`` that talk along ``dim`` (for pp, ``a`` sends to the next stage
    ``b``). ``groups[rank][dim]``: the layout's group of ``rank`` along ``dim``, in coordinate order.
    Every rank must appear in the pairs of each dim of size 2, paired with the other member of its
    group, and a pp pair must go from one stage to the next.
    """
    errors = []
    world = len(groups)
    for dim, pairs in comm_map.items():
        partner: dict[int, list[int]] = {}
        for a, b in pairs:
            partner.setdefault(a, []).append(b)
            partner.setdefault(b, []).append(a)
            for rank, other in ((a, b), (b, a)):
                if rank not in groups:
                    errors.append(f"{dim}: pair ({a}, {b}) names rank {rank}, outside the world of {world}")
                    continue
                group = groups[rank][dim]
                if other not in group:
                    errors.append(f"rank {rank}: the map pairs it with rank {other} along {dim}, but its {dim} "
                                  f"group in the layout {claim} is {group}")
            if dim == "pp" and a in groups and b in groups[a]["pp"]:
                stage = groups[a]["pp"]
                if stage.index(b) != stage.index(a) + 1:
                    errors.append(f"rank {a}: the map sends from it to rank {b} along pp, but in its pp group "
                                  f"{stage} rank {b} is not the next stage")
        for rank in range(world):
            if rank not in partner:
                errors.append(f"rank {rank}: in no {dim} pair of the map, but its {dim} group in the layout "
                              f"{claim} is {groups[rank][dim]}")
            elif len(partner[rank]) > 1:
                errors.append(f"rank {rank}: in {len(partner[rank])} {dim} pairs of the map "
                              f"(with {partner[rank]}), its {dim} group in the layout {claim} is {groups[rank][dim]}")
    return errors
