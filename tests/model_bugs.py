"""Users' parallelize functions with planted bugs (tests/test_model_bugs.py), each a mistake a team
makes in its own parallelize code, on harness/examples/titan.py's model. Never flags in production code: each
bug is a different parallelize function registered as an implementation of the ``bugs`` model."""
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from harness import events
from harness.model import ModelCase
from harness.examples import titan


def wo_colwise(model, meshes):
    """TP plan that shards the attention's ``wo`` colwise instead of rowwise."""
    return titan.parallelize_stage(model, meshes, loss_parallel=True, plan=titan.block_plan(wo=ColwiseParallel()))


def norm_without_sequence_parallel(model, meshes):
    """TP plan that forgets ``SequenceParallel`` on the feed-forward norm."""
    plan = titan.block_plan(sequence_parallel_norms=("attention_norm",))
    return titan.parallelize_stage(model, meshes, loss_parallel=True, plan=plan)


def hsdp_wrong_dims(model, meshes):
    """HSDP whose FSDP2 mesh is built from the wrong dims: the shard dim alone, so the replicate
    dim's gradients are never averaged (each replica trains on its half of the batch)."""
    return titan.parallelize_stage(model, meshes, loss_parallel=True, hsdp_dims=("dp",))


def loss_over_world_twice(model, meshes):
    """The loss divided by the world size for data parallelism by hand (on the gradient entering
    the output head), while FSDP2 averages the gradients over the same ranks as well."""
    world = meshes.spec.world
    model.output.register_full_backward_pre_hook(lambda module, grad: (grad[0] / world,))
    return titan.parallelize_stage(model, meshes, loss_parallel=True)


def tp_without_sequence_parallel(model, meshes, partial_wo: tuple[str, ...] = ()):
    """Tensor parallelism without sequence parallelism (the residual stream replicated, each block's
    ``wo`` and ``w2`` rowwise and reduced); the blocks named in ``partial_wo`` keep their ``wo``'s
    output ``Partial()``: each rank's partial sum, which the residual add then uses unreduced."""
    tp = meshes.dense["tp"]
    parallelize_module(model, tp, {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
                                   "output": ColwiseParallel(output_layouts=Replicate())})
    for name, block in model.layers.items():
        wo = RowwiseParallel(output_layouts=Partial()) if name in partial_wo else RowwiseParallel()
        parallelize_module(block, tp, {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": wo, "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel()})
    return model


def wo_partial_in_one_block(model, meshes):
    """The same plan with the second block's ``wo`` left as partial sums over tp."""
    return tp_without_sequence_parallel(model, meshes, partial_wo=("1",))


def wo_scaled_in_one_block(model, meshes):
    """The same plan with a forward hook of the user's on the second block's ``wo`` (after its
    ``RowwiseParallel``'s own) that scales what it returns: every rank agrees, the reference does not."""
    made = tp_without_sequence_parallel(model, meshes)
    made.layers["1"].attention.wo.register_forward_hook(lambda module, args, out: out * 1.01)
    return made


def stage_reinitialised(model, meshes):
    """1F1B over pp=2 whose second stage initialises its attention's query weights again after the
    split (as a script does that builds its stages and calls each stage's init, the start it was
    given loaded into the first stage only): the stage's numbers part at that module."""
    made = titan.pipeline(model, meshes, interleaved=False)
    stage = made.modules[0]
    if "1" in stage.layers:
        with torch.no_grad():
            torch.nn.init.normal_(stage.layers["1"].attention.wq.weight, std=0.02)
    return made


def gradients_kept(model, meshes):
    """A trainer's own gradient buffer for the output head that nothing zeroes between steps (a
    hand-rolled accumulation): step 1's gradients are right, every later step's hold the steps
    before it too."""
    made = titan.parallelize_stage(model, meshes, loss_parallel=True)
    kept = []

    def accumulate(weight):
        if kept:
            weight.grad += kept[0]
        kept[:] = [weight.grad.detach().clone()]
    made.output.weight.register_post_accumulate_grad_hook(accumulate)
    return made


def fails_when_recorded(model, meshes, die: bool = False):
    """The norm-without-SP bug in a model that fails only in the diagnosis's rerun, which records each
    module's tensors (as code that breaks under hooks or on a second run does): at step 2 every rank
    raises, or (``die``) rank 1 exits."""
    made = norm_without_sequence_parallel(model, meshes)
    calls = []

    def fail(module, args):
        calls.append(1)
        if events.active() and len(calls) == 2:
            if die and dist.get_rank() == 1:
                os._exit(3)
            raise RuntimeError("the output head's second call while recording")
    made.output.register_forward_pre_hook(fail)
    return made


BUGS = ModelCase(build=titan.Transformer, batch=titan.batch, loss=titan.loss, parallelize={
    "wocol": wo_colwise, "nosp": norm_without_sequence_parallel, "hsdpdims": hsdp_wrong_dims,
    "lossworld": loss_over_world_twice, "stagereinit": stage_reinitialised, "tpnosp": tp_without_sequence_parallel,
    "wopartial": wo_partial_in_one_block, "wohook": wo_scaled_in_one_block, "gradkept": gradients_kept,
    "rerunraises": fails_when_recorded, "rerundies": lambda model, meshes: fails_when_recorded(model, meshes, die=True)})


# ---- a tied embedding across pipeline stages --------------------------------------------------------
def tied_pipeline(model, meshes, sync: bool = True):
    """1F1B over pp=2 of the tied model: the embedding on stage 0 and the head on stage 1 are copies
    of one parameter, whose gradients must be summed over the two stages before every step."""
    made = titan.pipeline(model, meshes, interleaved=False)
    module = made.modules[0]
    tied = module.tok_embeddings.weight if module.tok_embeddings is not None else module.output.weight

    def sum_tied_gradients():
        dist.all_reduce(tied.grad, group=meshes.group("pp"))

    return titan.Pipelined(made.stages, made.schedule, before_step=sum_tied_gradients if sync else None)


def untied_pipeline(model, meshes):
    """The same pipeline whose tied embedding is not tied: no gradient sum across the stages."""
    return tied_pipeline(model, meshes, sync=False)


TIED = ModelCase(build=lambda: titan.Transformer(tied=True), batch=titan.batch, loss=titan.loss,
                 parallelize={"tied": tied_pipeline, "untied": untied_pipeline},
                 supports={name: lambda spec: None if spec.pp == 2 and spec.world == 2 else "pp=2 only"
                           for name in ("tied", "untied")})
