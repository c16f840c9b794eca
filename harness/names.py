"""The project's one vocabulary: the names of mesh dims and of results.

**Mesh dims.** A cell id, :mod:`harness.meshes` (its ``MeshSpec`` fields and the ``DeviceMesh`` dim
names), ``ModelCase.placements`` and every ``Piece`` name the dims of a training mesh alike:

=========  ==================================================  ==============  ========
dim        what its ranks split                                torchtitan      Megatron
=========  ==================================================  ==============  ========
``pp``     the layers, into pipeline stages                    ``pp``          ``pp``
``rep``    the batch, holding whole replicas (HSDP's outer)    ``dp_replicate``
``dp``     the batch, sharding parameters (FSDP)               ``dp_shard``    ``dp``
``cp``     the sequence (context parallel)                     ``cp``          ``cp``
``tp``     the weights of each layer (tensor parallel)         ``tp``          ``tp``
``ep``     the experts, borrowed from ``dp·cp`` (·``tp``)      ``ep``          ``ep``
``etp``    each expert's weights: ``tp`` or 1                  (1)             ``etp``
``efsdp``  what the expert block leaves: dp·cp·tp / (ep·etp)   ``efsdp``
``batch``  rep·dp: the ranks that read different data          ``dp`` (batch)  ``dp``
``loss``   rep·dp·cp: the ranks a token-mean loss spans        ``loss``        ``dp-cp``
``fsdp``   dp·cp: the ranks that shard parameters              ``dp_shard_cp``
=========  ==================================================  ==============  ========

A ``parallelize`` written against another trainer's names asks for them (``ModelCase.mesh_names``:
:func:`mesh_names`); ids, placements and messages keep these.

Dense dims are laid out slowest first in :data:`DENSE` order; the sparse (expert) mesh in
:data:`SPARSE` order over the same ranks. A component's own cells may name other dims (``w``,
``shard``): those are its own, declared in its ``Space``.

**Results.** What a rank returns and the reference computes, by name: ``loss``, ``out``,
``grad/<param>``, ``param/<param>`` (after the optimizer step), ``opt/<state>/<param>``; a result of one
step of several is prefixed ``step<k>/`` (``step2/grad/w1``), and a whole model's loss of step ``k``
is ``loss/step<k>``. :func:`parse` reads a name back.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

# ---- mesh dims -------------------------------------------------------------------------------------
DENSE = ("pp", "rep", "dp", "cp", "tp")
SPARSE = ("pp", "rep", "efsdp", "ep", "etp")
FLATTENED = {"batch": ("rep", "dp"), "loss": ("rep", "dp", "cp"), "fsdp": ("dp", "cp")}
# every named group, in the order they are reported; pp and rep are dims of both meshes
GROUPS = DENSE + tuple(FLATTENED) + ("efsdp", "ep", "etp")
# the degrees a user sets; efsdp is derived
DEGREES = ("pp", "rep", "dp", "cp", "tp", "ep", "etp")
# other trainers' names for ours, for the messages that say which one is meant
ELSEWHERE = {"dp_replicate": "rep", "dp_shard": "dp", "dp_shard_cp": "fsdp", "dp_cp": "loss"}


# torchtitan's names for the groups whose names differ (``ParallelDims``); the rest are alike
TORCHTITAN = {"rep": "dp_replicate", "dp": "dp_shard", "batch": "dp", "fsdp": "dp_shard_cp", "loss": "dp_cp"}


def mesh_names(given: "str | dict[str, str] | None") -> dict[str, str]:
    """The names a case's ``parallelize`` sees the meshes' dims and groups by (``ModelCase.mesh_names``):
    ours -> its, for those that differ. ``"torchtitan"`` is :data:`TORCHTITAN`; a mapping names its
    own (``{"dp": "shard"}``); None: ours. Raises ValueError naming what is wrong and the fix."""
    if given is None:
        return {}
    if isinstance(given, str):
        if given != "torchtitan":
            raise ValueError(f"ModelCase.mesh_names={given!r}: give 'torchtitan', or a mapping from the "
                             f"harness's names ({', '.join(GROUPS)}) to yours, such as {{'dp': 'shard'}}")
        return dict(TORCHTITAN)
    if not hasattr(given, "items"):
        raise ValueError(f"ModelCase.mesh_names={given!r}: give 'torchtitan', or a mapping such as {{'dp': 'shard'}}")
    out = {}
    for ours, theirs in given.items():
        if ours not in GROUPS:
            raise ValueError(f"ModelCase.mesh_names: {unknown_dim(ours, GROUPS)}; its keys are the harness's "
                             "names, its values yours")
        if not (isinstance(theirs, str) and theirs.isidentifier()):
            raise ValueError(f"ModelCase.mesh_names[{ours!r}] = {theirs!r}: a mesh dim's name is a word "
                             "(letters, digits, underscores)")
        if theirs != ours:
            out[ours] = theirs
    shown = [out.get(n, n) for n in GROUPS] + ["world", "copy"]  # the latter two: the meshes' roots
    twice = sorted({n for n in shown if shown.count(n) > 1})
    if twice:
        raise ValueError(f"ModelCase.mesh_names: {', '.join(map(repr, twice))} would name two groups; rename "
                         f"the harness's group of that name too (its groups: {', '.join(GROUPS)})")
    return out


def unknown_dim(name: str, known) -> str:
    """Why ``name`` is not a dim here, and what to write instead."""
    return f"unknown mesh dim {name!r}: the dims are {', '.join(known)}{dim_hint(name, known)} (harness.names)"


def dim_hint(name: str, known=DEGREES) -> str:
    """``; torchtitan's 'dp_shard' is 'dp' here``, or ``; did you mean 'dp'?`` for a near miss of
    ``known``, or ""."""
    import difflib

    ours = ELSEWHERE.get(name)
    if ours:
        return f"; torchtitan's {name!r} is {ours!r} here"
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


# ---- results ------------------------------------------------------------------------------------------
def grad_name(param: str) -> str:
    """A parameter's (or an input's) gradient."""
    return f"grad/{param}"


def param_name(param: str) -> str:
    """A parameter's value after the optimizer step."""
    return f"param/{param}"


def state_name(key: str, param: str) -> str:
    """A parameter's optimizer state ``key`` (``exp_avg``, ``exp_avg_sq``)."""
    return f"opt/{key}/{param}"


def step_name(step: int, name: str) -> str:
    """Result ``name`` of optimizer step ``step`` (1-based) of several: ``step2/grad/w1``."""
    return f"step{step}/{name}"


def step_grad_name(step: int, param: str) -> str:
    """A whole model's gradient of ``param`` at its optimizer step ``step`` (1-based): ``grad/<p>``
    at step 1, ``step<k>/grad/<p>`` after it."""
    return grad_name(param) if step == 1 else step_name(step, grad_name(param))


def loss_name(step: int) -> str:
    """A whole model's loss of step ``step`` (1-based)."""
    return f"loss/step{step}"


# a reference result holding only this name: why no cell of its problem can be judged (a model that
# draws random numbers in training mode), and what to change
NOT_JUDGED = "not-judged"


@dataclass(frozen=True)
class ResultName:
    """A result's name read back: ``kind`` is ``grad``, ``param``, ``opt``, ``loss`` or the name itself
    (``out``, ``lse``, ...); ``param`` the parameter it belongs to; ``state`` the optimizer state's key;
    ``step`` the step it was taken at (None: the only one, or the end)."""

    kind: str
    param: str = ""
    state: str = ""
    step: int | None = None


_STEP = re.compile(r"step(\d+)/(.*)")
_LOSS = re.compile(r"loss/step(\d+)")


def unstepped(name: str) -> str:
    """``name`` without the step it was taken at (``step3/grad/w``: ``grad/w``)."""
    m = _STEP.fullmatch(name)
    return m.group(2) if m else name


def parse(name: str) -> ResultName:
    """The parts of a result name (see the module docstring)."""
    step = None
    m = _STEP.fullmatch(name)
    if m:
        step, name = int(m.group(1)), m.group(2)
    m = _LOSS.fullmatch(name)
    if m:
        return ResultName("loss", step=int(m.group(1)))
    kind, _, rest = name.partition("/")
    if kind == "opt" and "/" in rest:
        state, _, param = rest.partition("/")
        return ResultName("opt", param, state, step)
    if kind in ("grad", "param") and rest:
        return ResultName(kind, rest, step=step)
    return ResultName(name, step=step)
