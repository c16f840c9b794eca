"""Expert parallelism through Hugging Face transformers (``transformers.distributed.expert_parallel``).

Read beside ``reference/moe.py`` and ``harness/parallel/moe.py``: the same layer as transformers' own Qwen3-MoE
sparse block (``Qwen3MoeSparseMoeBlock``: a ``Qwen3MoeTopKRouter`` and ``Qwen3MoeExperts``), with the
reference's parameters mapped onto the library's layout::

    reference                          transformers
    router [e, h]                      gate.weight [e, h]          (softmax, top-k, norm_topk_prob = norm)
    w_gate, w_up [e, f, h]             experts.gate_up_proj [e, 2f, h] = cat(w_gate, w_up) (chunk(2): gate, up)
    w_down [e, h, f]                   experts.down_proj [e, h, f]
    aux (Switch, over t*k slots)       load_balancing_loss_func(logits, e, k) / k (it counts slots per token)

parallelized by transformers' own ``apply_expert_parallelism(model, ep_mesh, tp_mesh, plan,
ep_implementation)`` with the plan its MoE configs declare (``base_model_ep_plan``)::

    experts.gate_up_proj: grouped_gemm    experts.down_proj: grouped_gemm    experts: ep_dispatch_experts

``grouped_gemm`` shards the experts (dim 0) over ep; ``ep_dispatch_experts`` replaces the experts'
forward by the ``EPImplementation`` named by switch ``epimpl``: ``alltoall`` = ``all_to_all`` (tokens to the experts'
ranks and back; the routing weights are applied on the sender) or ``allreduce`` = ``all_reduce`` (every rank of a
shared batch runs its own experts on every token, partial outputs summed; only where the expert
group holds one batch). Switch ``experts`` (optional; absent = ``eager``, the experts class's own
loop) picks the experts' forward transformers dispatches to: ``groupedmm`` = ``grouped_mm``,
``batchedmm`` = ``batched_mm``, where EP's off-rank (sentinel) rows are masked rather than skipped.

Meshes, as transformers lays them out (``TransformersDeviceMesh``: dense ``fsdp x tp``, experts
``efsdp x ep``, ep a multiple of tp): the expert mesh's ``ep`` dim is ``ep_mesh``; ``tp_mesh`` is the
group of ranks that hold the same batch (transformers slices the batch over it before the exchange
and gathers the output back). For cells whose mesh has no tp dim that is a one-rank dim, declared by
:func:`harness.parallel.thirdparty_moe.moe_meshes` as transformers' dense view ``fsdp=world x tp=1`` (never
built in a task). The router and the aux loss run on every rank of a tp group on the whole batch.

What the library does not do is done here the way its users do it: the step (SGD, as
``harness/parallel/moe.py``), the gradient sums over the ranks that split the tokens (router) or hold copies
of the same experts (efsdp), and the aux loss over the global batch (the router logits are gathered
over the token ranks first: transformers' models call the function on each rank's own batch, which
is not the global Switch loss the reference defines). transformers has no capacity, no sigmoid
router paired with a Switch aux loss, and no expert tensor parallelism with EP: those cells skip
(``harness/parallel/thirdparty_moe.py``), and ``dropped`` is omitted (nothing is ever dropped).
"""
from __future__ import annotations

import torch

from harness.config import Config
from harness.context import RankContext
from harness.layout import Piece, Shard, take
from harness.names import grad_name, param_name
from reference.common import probe_loss, sgd_step
from reference.moe import AUX_WEIGHT, has_aux, make_problem

from .collectives import all_reduce_, gather_from_group
from .moe import expert_placements, layout
from .thirdparty_moe import HF_EP_IMPLEMENTATIONS, HF_EXPERTS, hf_experts, hf_moe_dense_view

try:  # imported here so the pool's zygote pays for it once; absent, every cell skips in the parent
    from transformers.distributed.expert_parallel import apply_expert_parallelism
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock, load_balancing_loss_func
except ImportError:  # pragma: no cover  harness.parallel.thirdparty_moe.hf_moe_skip says how to install it
    apply_expert_parallelism = None

# the expert parallel plan of transformers' MoE configs (Qwen3MoeConfig.base_model_ep_plan, per layer)
EP_PLAN = {"experts.gate_up_proj": "grouped_gemm", "experts.down_proj": "grouped_gemm",
           "experts": "ep_dispatch_experts"}


def build(cfg: Config, params: dict[str, torch.Tensor]) -> "Qwen3MoeSparseMoeBlock":
    """transformers' sparse MoE block holding the reference's parameters (full, before sharding)."""
    config = Qwen3MoeConfig(hidden_size=cfg.size("h"), moe_intermediate_size=cfg.size("f"),
                            num_experts=cfg.size("e"), num_experts_per_tok=cfg.size("k"),
                            norm_topk_prob=cfg.switch("norm") == "on", hidden_act="silu",
                            experts_implementation=HF_EXPERTS[hf_experts(cfg)])
    block = Qwen3MoeSparseMoeBlock(config)
    block.gate.weight = torch.nn.Parameter(params["router"].clone())
    # packed [gate; up] along the FFN dim: the experts' forward splits it with chunk(2, dim=-1)
    block.experts.gate_up_proj = torch.nn.Parameter(torch.cat([params["w_gate"], params["w_up"]], dim=1))
    block.experts.down_proj = torch.nn.Parameter(params["w_down"].clone())
    return block


def forward(block, x: torch.Tensor):
    """The block's forward (Qwen3MoeSparseMoeBlock.forward, unrolled to keep the router's logits and
    choices for the aux loss and the ``route`` result)."""
    logits, weights, route = block.gate(x)
    return block.experts(x, route, weights), logits, route


def run(ctx: RankContext, cfg: Config) -> dict[str, Piece]:
    """One training step of transformers' expert-parallel MoE block on this rank."""
    problem, lay = make_problem(cfg), layout(cfg)
    e, k = cfg.size("e"), cfg.size("k")
    dense = cfg.switch("emesh") == "dense"
    ep_mesh = (ctx.device_mesh if dense else ctx.mesh(lay.expert_dims))["ep"]
    tp_mesh = ctx.device_mesh["tp"] if "tp" in ctx.layout.names else ctx.mesh(hf_moe_dense_view(cfg))["tp"]
    edp = ctx.mesh(lay.expert_dims).get_group("edp") if "edp" in dict(lay.expert_dims) else None
    tokens_group = ctx.group(lay.token_dim)  # ranks holding distinct tokens (replicated over tp)

    block = build(cfg, problem.params)
    apply_expert_parallelism(block, ep_mesh, tp_mesh, EP_PLAN,
                             ep_implementation=HF_EP_IMPLEMENTATIONS[cfg.switch("epimpl")])

    batch = Shard(0)
    degree, coord = ctx.degree(lay.token_dim), ctx.coord(lay.token_dim)
    x = take(problem.x, batch, degree, coord).requires_grad_()
    out, logits, route = forward(block, x)
    probe = take(problem.probe, batch, degree, coord)
    main = probe_loss(out, probe, problem.tokens)  # partial over the token ranks
    loss = main
    if has_aux(cfg):  # aux_off: the block alone, as transformers ships it (the aux loss is the CausalLM head's)
        every = gather_from_group(logits, 0, tokens_group, problem.tokens)  # backward: this rank's rows
        aux = load_balancing_loss_func((every,), e, k) / k
        loss = main + AUX_WEIGHT * aux
    loss.backward()

    router = block.gate.weight
    experts = {"gate_up_proj": block.experts.gate_up_proj, "down_proj": block.experts.down_proj}
    local = {name: p.to_local().detach() for name, p in experts.items()}  # DTensors sharded over ep
    grads = {name: p.grad.to_local() for name, p in experts.items()}
    all_reduce_([router.grad], tokens_group)  # each rank saw its tokens only
    all_reduce_(list(grads.values()), edp)  # complete within an ep group; copies over efsdp
    main = main.detach().clone()
    all_reduce_([main], tokens_group)
    with torch.no_grad():
        for name, p in local.items():
            p.grad = grads[name]
        sgd_step([router, *local.values()])

    t, h = problem.x.shape
    f = cfg.size("f")
    on_tokens = {lay.token_dim: batch}
    pieces = {
        "out": Piece.sharded(out, (t, h), **on_tokens),
        "loss": Piece.full(main + AUX_WEIGHT * aux.detach()) if has_aux(cfg) else Piece.full(main),
        "route": Piece.sharded(route.float(), (t, k), **on_tokens),
        grad_name("x"): Piece.sharded(x.grad, (t, h), **on_tokens),
        grad_name("router"): Piece.full(router.grad),
        param_name("router"): Piece.full(router),
    } | ({"aux": Piece.full(aux.detach())} if has_aux(cfg) else {})
    split = {"w_gate": ("gate_up_proj", slice(0, f)), "w_up": ("gate_up_proj", slice(f, 2 * f)),
             "w_down": ("down_proj", slice(None))}
    for name, (module_param, rows) in split.items():
        where = expert_placements(cfg, name)
        shape = problem.params[name].shape
        pieces[grad_name(name)] = Piece.sharded(grads[module_param][:, rows], shape, **where)
        pieces[param_name(name)] = Piece.sharded(local[module_param][:, rows], shape, **where)
    return pieces

