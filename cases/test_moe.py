"""Expert parallelism: harness/parallel/moe.py against reference/moe.py.

How the matrix is chosen (not the full product, which would be ~2,000 cells):

* Meshes (the axis that finds parallel bugs), 13 of them, each with its expert mesh (switch emesh):
  ep in {1, 2, 3, 4, 8} (emesh_dense: the cell's mesh is the expert mesh); ep x etp in {2x2, 4x2, 2x4};
  dp2ep: dp=4 with ep in {2, 4}, dp=8 with ep=4; and dense meshes that differ from the expert mesh:
  dense dp=2,tp=2 with experts ep=4 (tp ranks route their own token chunks), dense dp=4,tp=2 with
  experts edp=2 x ep=2 x etp=2 (the dense tp ranks are the experts' FFN shards), dense dp=2,tp=2 with
  experts edp=2 x ep=2 (ep inside each tp line). The last three and dp2ep are where a group taken
  from the wrong mesh shows.
* Routing: six combos of (top-k, capacity, score, norm) that cover every pair of values of
  k in {1, 2}, cap in {none, 100, 125} (dropless, 1.0, 1.25) and score in {softmax, sigmoid}
  (a pairwise covering design); norm_on only with k=2, where renormalised gates still carry a
  gradient. Every mesh runs all six in fp32 and two of them (rotating through the six) in bf16.
* Experts: e in {4, 8, 16} where ep divides it (6 for ep=3), rotating with the combo, so every mesh
  meets every expert count it can hold and each combo meets several.
* Edge cells: every token's first choice the same expert (route_one), an expert and a whole ep rank
  receiving no token (route_skew), top-k = e, k=1 with renormalised gates (gate = 1: the router
  learns only from the aux loss), on meshes of each kind, in both dtypes.

Implementation ``hf`` (transformers' apply_expert_parallelism, ``harness/parallel/moe_hf.py``) runs a small
matrix of its own, ~36 cells: only what transformers can express (dropless, softmax router, no etp,
ep a multiple of the dense tp), on the meshes where its code paths differ: one rank, dense ep 2 and 4
(tp_mesh of one rank), dp2ep with efsdp copies (dp=4 ep2) and without (dp=4 ep4), dense tp ranks
slicing the batch before the exchange (dp=2,tp=2 with ep=4 and with ep=tp=2); every (k, norm) in
fp32 (the one-rank mesh once), four meshes once in bf16; its second EPImplementation (switch
epimpl, all_reduce) where the expert group shares one batch; a starved ep rank and one-expert routing; the experts' grouped_mm and
batched_mm kernels (switch experts, absent = eager) on both EPImplementations; and the cells it is
declared to get wrong (strict xfail) or cannot run (skip), from ``harness/parallel/thirdparty_moe.py``.
"""
import pytest

from harness.config import Config
from harness.matrix import mesh as parse
from reference.moe import SIZES

# (cell mesh, expert mesh): emesh_dense, or the expert mesh borrowed from the dense dp[,tp] dims
MESHES = [
    ("ep=1", "dense"), ("ep=2", "dense"), ("ep=3", "dense"), ("ep=4", "dense"), ("ep=8", "dense"),
    ("ep=2,etp=2", "dense"), ("ep=4,etp=2", "dense"), ("ep=2,etp=4", "dense"),
    ("dp=4", "ep2"), ("dp=4", "ep4"), ("dp=8", "ep4"),
    ("dp=2,tp=2", "ep4"), ("dp=4,tp=2", "ep2etp2"), ("dp=2,tp=2", "ep2"),
]
# (k, cap, score, norm): every pair of k x cap, cap x score and k x score appears
COMBOS = [
    (1, "none", "softmax", "off"), (2, "100", "softmax", "on"), (2, "125", "sigmoid", "off"),
    (1, "100", "sigmoid", "off"), (2, "none", "sigmoid", "on"), (1, "125", "softmax", "off"),
]
# (cell mesh, expert mesh, dtype, e, k, cap, score, norm, route)
EDGES = [
    ("ep=4", "dense", "fp32", 4, 1, "none", "softmax", "off", "one"),
    ("ep=2", "dense", "fp32", 8, 2, "125", "sigmoid", "off", "one"),
    ("dp=4", "ep2", "fp32", 4, 1, "100", "softmax", "off", "one"),
    ("ep=2,etp=2", "dense", "bf16", 4, 1, "none", "sigmoid", "off", "one"),
    ("ep=2", "dense", "fp32", 4, 2, "none", "softmax", "off", "skew"),
    ("ep=4", "dense", "fp32", 8, 1, "125", "softmax", "off", "skew"),
    ("dp=4", "ep2", "fp32", 4, 1, "none", "sigmoid", "off", "skew"),
    ("ep=4,etp=2", "dense", "fp32", 8, 2, "100", "softmax", "on", "skew"),
    ("dp=2,tp=2", "ep4", "bf16", 8, 2, "none", "sigmoid", "off", "skew"),
    ("ep=2", "dense", "fp32", 4, 4, "none", "softmax", "on", "rand"),
    ("ep=4", "dense", "fp32", 4, 4, "100", "sigmoid", "off", "rand"),
    ("dp=8", "ep4", "bf16", 4, 4, "125", "softmax", "off", "rand"),
    ("ep=2", "dense", "fp32", 4, 1, "none", "softmax", "on", "rand"),
]


def experts_for(mesh: str, emesh: str) -> list[int]:
    dims = dict(parse(mesh))
    ep = dims.get("ep", 1) if emesh == "dense" else int(emesh[2:].split("etp")[0])
    return [6] if ep == 3 else [e for e in (4, 8, 16) if e % ep == 0]


def cell(mesh, emesh, dtype, e, k, cap, score, norm, route="rand") -> Config:
    return Config("moe", "ours", parse(mesh), dtype, dict(SIZES, e=e, k=k),
                  dict(emesh=emesh, cap=cap, score=score, norm=norm, route=route))


# transformers' expert parallelism (impl hf): the meshes it can lay out (ep a multiple of the dense tp,
# no etp), dropless softmax routing, its two training EPImplementations (switch epimpl)
HF_MESHES = [("ep=1", "dense"), ("ep=2", "dense"), ("ep=4", "dense"), ("dp=4", "ep2"), ("dp=4", "ep4"),
             ("dp=2,tp=2", "ep4"), ("dp=2,tp=2", "ep2")]
HF_COMBOS = [(1, "off"), (2, "on"), (2, "off")]  # (k, norm); cap none, score softmax
# (cell mesh, expert mesh, dtype, e, k, norm, route, epimpl)
HF_EXTRA = [
    ("dp=2,tp=2", "ep2", "fp32", 4, 2, "on", "rand", "allreduce"),
    ("dp=2,tp=2", "ep2", "fp32", 8, 1, "off", "rand", "allreduce"),
    ("dp=2,tp=2", "ep2", "bf16", 4, 2, "off", "rand", "allreduce"),
    ("ep=4", "dense", "fp32", 8, 1, "off", "skew", "alltoall"),
    ("dp=4", "ep2", "fp32", 4, 2, "off", "one", "alltoall"),
    # declared: AllReduceEP with a starved rank (skip: it hangs), and one cell of each bf16 router divergence
    ("dp=2,tp=2", "ep2", "fp32", 8, 1, "off", "skew", "allreduce"),
    ("ep=2", "dense", "bf16", 16, 2, "off", "skew", "alltoall"),
    ("dp=2,tp=2", "ep4", "bf16", 16, 1, "on", "rand", "alltoall"),
    # the experts' kernel paths (switch experts): EP's sentinel rows are masked there, not skipped
    ("ep=4", "dense", "fp32", 8, 2, "on", "rand", "alltoall", "groupedmm"),
    ("dp=2,tp=2", "ep2", "fp32", 8, 2, "off", "rand", "allreduce", "groupedmm"),
    ("dp=2,tp=2", "ep2", "fp32", 8, 1, "off", "skew", "allreduce", "groupedmm"),
    ("ep=4", "dense", "fp32", 8, 2, "on", "rand", "alltoall", "batchedmm"),
    ("dp=2,tp=2", "ep2", "fp32", 8, 1, "off", "skew", "allreduce", "batchedmm"),
]


def hf_cell(mesh, emesh, dtype, e, k, norm, route="rand", epimpl="alltoall", experts=None) -> Config:
    switches = dict(emesh=emesh, cap="none", score="softmax", norm=norm, route=route, epimpl=epimpl)
    return Config("moe", "hf", parse(mesh), dtype, dict(SIZES, e=e, k=k),
                  switches | ({"experts": experts} if experts else {}))  # absent: eager experts


def hf_matrix() -> list[Config]:
    """Every hf mesh with every (k, norm) in fp32 (the one-rank mesh once), four of them once in
    bf16, then all_reduce, the starved-rank / one-expert routes, the declared cells and the kernels."""
    out = []
    for m, (mesh, emesh) in enumerate(HF_MESHES):
        experts = experts_for(mesh, emesh)
        for c, combo in enumerate(HF_COMBOS[:1] if mesh == "ep=1" else HF_COMBOS):  # one rank: the mapping once
            out.append(hf_cell(mesh, emesh, "fp32", experts[(m + c) % len(experts)], *combo))
        if m % 2 or m == len(HF_MESHES) - 1:
            out.append(hf_cell(mesh, emesh, "bf16", experts[m % len(experts)], *HF_COMBOS[m % len(HF_COMBOS)]))
    return out + [hf_cell(*extra) for extra in HF_EXTRA]


def matrix() -> list[Config]:
    out = []
    for m, (mesh, emesh) in enumerate(MESHES):
        experts = experts_for(mesh, emesh)
        for c, combo in enumerate(COMBOS):
            out.append(cell(mesh, emesh, "fp32", experts[c % len(experts)], *combo))
        for c in (2 * m % len(COMBOS), (2 * m + 3) % len(COMBOS)):
            out.append(cell(mesh, emesh, "bf16", experts[(c + 1) % len(experts)], *COMBOS[c]))
    return out + [cell(*edge) for edge in EDGES]


# switch aux_off: a layer without a load-balancing loss (transformers' blocks ship none; theirs is the
# CausalLM head's): the router learns through the gates alone. One cell per kind of mesh, both impls.
AUX_OFF = [
    cell("ep=2", "dense", "fp32", 4, 2, "none", "softmax", "on"),
    cell("ep=4", "dense", "bf16", 8, 1, "125", "sigmoid", "off"),
    cell("ep=2,etp=2", "dense", "fp32", 8, 2, "100", "softmax", "off"),
    cell("dp=2,tp=2", "ep4", "fp32", 8, 2, "none", "sigmoid", "off"),
    hf_cell("ep=2", "dense", "fp32", 4, 2, "on"),
    hf_cell("dp=4", "ep2", "fp32", 8, 1, "off"),
    hf_cell("dp=2,tp=2", "ep2", "fp32", 4, 2, "off", epimpl="allreduce"),
]
AUX_OFF = [cfg.replace(switches=dict(cfg.switches, aux="off")) for cfg in AUX_OFF]

CELLS = matrix() + hf_matrix() + AUX_OFF


@pytest.mark.parametrize("cfg", CELLS, ids=str)
def test_moe(cfg, parity):
    parity(cfg)
