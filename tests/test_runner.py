"""The one runner contract (harness/runner.py): the warm pool and torchrun's runner both have it."""
import inspect
from types import SimpleNamespace

from harness.pool.parent import Pool
from harness.runner import Runner
from harness.torchrun.runner import RankRunner

METHODS = ("run", "alone", "new_scratch")
ATTRIBUTES = ("size", "backend", "deadline", "can_rerun")


def drift(runner) -> list[str]:
    """How ``runner`` (an instance) departs from :class:`Runner`: a member missing, or a method whose
    signature lacks one of the contract's parameters, names it with another kind or default, or
    adds one a caller cannot leave out."""
    found = [f"no {name}" for name in ATTRIBUTES if not hasattr(runner, name)]
    for name in METHODS:
        method = getattr(runner, name, None)
        if not callable(method):
            found.append(f"no {name}()")
            continue
        want = inspect.signature(getattr(Runner, name)).parameters
        have = inspect.signature(method).parameters
        for p in list(want.values())[1:]:  # past self
            q = have.get(p.name)
            if q is None:
                found.append(f"{name}() lacks {p.name}")
            elif (q.kind, q.default) != (p.kind, p.default):
                found.append(f"{name}() {p.name}: {q.kind.description}, default {q.default!r}; "
                             f"the contract: {p.kind.description}, default {p.default!r}")
        for q in have.values():
            if q.name not in want and (q.kind is not q.KEYWORD_ONLY or q.default is q.empty):
                found.append(f"{name}() adds {q.name}, which a caller cannot leave out")
    return found


def rank_runner() -> RankRunner:
    env = SimpleNamespace(run_id="contract", master_port=0, attempt=0)
    session = SimpleNamespace(rank=0, world=2, backend="gloo", deadline=30.0, env=env)
    return RankRunner(session, scratch_root="/nonexistent")


def test_the_pool_and_torchruns_runner_have_the_one_contract():
    pool = Pool(2)  # not started: started by its first task
    for runner in (pool, rank_runner()):
        assert drift(runner) == [], type(runner).__name__
        assert isinstance(runner, Runner)


def test_the_contract_check_finds_what_drifted():
    class Drifted:
        size, backend, deadline = 2, "gloo", 30.0  # no can_rerun

        def run(self, fn, payload, mesh, *, seed=1, label="", extra_meshes=(), scratch=None, gather):
            pass  # seed's default changed, deadline dropped, a required keyword added

        def alone(self, fn, payload, mesh, seed=0, deadline=None, label=""):
            pass  # seed and the rest positional

    found = drift(Drifted())
    positional = "positional or keyword"
    assert found == ["no can_rerun",
                     "run() seed: keyword-only, default 1; the contract: keyword-only, default 0",
                     "run() lacks deadline",
                     "run() lacks fresh",
                     "run() adds gather, which a caller cannot leave out",
                     f"alone() seed: {positional}, default 0; the contract: keyword-only, default 0",
                     f"alone() deadline: {positional}, default None; the contract: keyword-only, default None",
                     f"alone() label: {positional}, default ''; the contract: keyword-only, default ''",
                     "no new_scratch()"], found
