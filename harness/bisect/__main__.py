"""Command line of ``python -m harness.bisect`` (see the package docstring, or ``--help``)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..config import Config, ConfigError
from ..commands import harness_command, shown
from ..pool.kept import KeptPoolError, idle_from_env
from ..pool.parent import Pool, preloads, shared_pool
from ..project import Project, load
from ..screen import fitted
from . import __doc__ as DOC
from .localise import located
from .runner import EXIT, Trials
from .shrink import Budget, Search

EPILOG = """exit codes:
  0    no divergence (check: the cell matches)
  1    divergence found (check: the cell diverges); the minimal config is in result.json
  2    usage error: a config id that does not parse, a component or implementation not registered
       where pytest looks from here, a directory pytest cannot collect, a bad option
  3    nondeterministic: two runs of the same cell disagree, so bisecting it would mislead
  4    budget exhausted (--max-trials, --max-seconds); the best config so far is reported
  125  check: the cell cannot run here (its rules, its implementation's skip, the pool size)
"""
# the harness's own files in a project, beside pytest's .pytest_cache under the rootdir; bisect's go
# in its bisect/ (--out elsewhere). Created with a .gitignore of "*", as hypothesis does .hypothesis/.
HOME = ".paritytest"
GITIGNORE = ("# Created by paritytest: what it writes here (bisect's results) is not for version control.\n"
             "# Delete this file to commit it; it is written again only if .paritytest is deleted.\n*\n")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m harness.bisect", description=DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="find the smallest config that fails the same way",
                         usage="python -m harness.bisect run [options] {<config id>,<component>} [-- <oracle command>]",
                         formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    run.add_argument("target", help="a config id, or a component name to bisect its first failing cell")
    run.add_argument("--max-trials", type=int, default=40, help="trials at most (default 40)")
    run.add_argument("--max-seconds", type=float, default=120.0, help="seconds at most (default 120)")
    run.add_argument("--out", help=f"where trials.jsonl and result.json go (default {HOME}/bisect in the project's "
                                    "rootdir, as pytest finds it from here; gitignored)")
    check = sub.add_parser("check", help="exit 0 if the cell matches, 1 if it diverges, 125 if it cannot run here",
                           formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    check.add_argument("target", help="a config id")
    for p in (run, check):
        p.add_argument("--pool-size", type=int, default=8, help="rank processes (default 8)")
        p.add_argument("--case-deadline", type=float, default=30.0, help="seconds per trial before it counts as a hang")
    return parser


def _usage(message: str) -> int:
    print(fitted(f"python -m harness.bisect: error: {message}"), file=sys.stderr)
    return EXIT["usage"]


def _reproduce(cfg: Config) -> str:
    """The command that checks ``cfg`` again, typed where bisect was, its interpreter named as a
    failing cell's ``reproduce:`` line names it (:mod:`harness.commands`)."""
    return harness_command("bisect", "check", cfg.id)


def _out(args, project: Project) -> Path:
    """Where bisect writes: ``--out``, else ``.paritytest/bisect`` in the project's rootdir (the
    ``.paritytest`` directory made with its ``.gitignore`` when it is new)."""
    if args.out is not None:
        out = Path(args.out)
    else:
        home = project.rootdir / HOME
        try:
            home.mkdir(parents=True)
        except FileExistsError:
            pass
        else:
            (home / ".gitignore").write_text(GITIGNORE)
        out = home / "bisect"
    out.mkdir(parents=True, exist_ok=True)
    return out


def check(args, project: Project) -> int:
    try:
        cfg = project.resolve(args.target)
    except ConfigError as error:
        return _usage(str(error))
    pool = Pool(**_pool_options(args, [cfg], project.rootdir))
    try:
        trial = Trials(pool, quiet=True, max_trials=1).run(cfg)
    finally:
        pool.close()
    kind = trial.signature.kind
    print(fitted(f"{cfg.id}: {trial.signature}"))
    if kind in ("skip", "invalid"):
        return EXIT["skip"]
    return EXIT["bad"] if trial.signature.failed else EXIT["good"]


def run(args, project: Project) -> int:
    if args.max_trials < 2 or args.max_seconds <= 0:
        return _usage("--max-trials needs at least 2 (the divergence is confirmed twice), --max-seconds > 0")
    try:  # a config id, or a component's first failing cell among those collected here
        original = project.resolve(args.target) if "-" in args.target else None
        cells = project.cells_of(args.target) if original is None else []
    except ConfigError as error:
        return _usage(str(error))
    out = _out(args, project)
    pool = shared_pool(**_pool_options(args, [original] if original else cells, project.rootdir))
    started = time.monotonic()
    with open(out / "trials.jsonl", "w") as log:
        trials = Trials(None if args.oracle else pool, log, args.max_trials, args.max_seconds, args.oracle or None)
        try:
            code = _bisect(args, original, cells, trials, out, started)
        except Budget as spent:
            best = trials.best
            _write_result(out, {"verdict": "budget exhausted", "budget": str(spent), "best": best and best.id,
                                "trials": trials.count})
            print("\n" + fitted(f"budget exhausted after {spent}; best so far: {best.id if best else 'none'}"))
            code = EXIT["budget"]
        except ConfigError as error:
            return _usage(str(error))
        finally:
            pool.close()
    print(fitted(f"wrote {shown(out / 'result.json')} and trials.jsonl beside it"))
    return code


def _pool_options(args, cfgs: list[Config], root: Path) -> dict:
    """The pool's options: its zygotes import the modules of ``cfgs``' components and
    implementations, which every trial shares (bisect changes sizes, meshes and switches, never
    them), not every registered one's: ``git bisect run`` starts a pool per commit, and transformers
    and Megatron-Core take seconds to import. With ``PARITYTEST_KEEP_POOL`` set, the kept pool of
    ``root``, the project's (as pytest's): each ``check`` of a ``git bisect run`` forks its ranks from it."""
    return dict(size=args.pool_size, deadline=args.case_deadline, keep=idle_from_env(), root=str(root),
                **preloads(cfgs))


def _first_failing(cells: list[Config], trials: Trials) -> Config | None:
    for cfg in cells:
        if trials.run(cfg, counted=False).signature.failed:
            return cfg
    return None


def _bisect(args, original: Config | None, cells: list[Config], trials: Trials, out: Path, started: float) -> int:
    if original is None:
        original = _first_failing(cells, trials)
        if original is None:
            print(fitted(f"every {args.target} cell collected here matches the reference"))
            _write_result(out, {"verdict": "no divergence", "component": args.target})
            return EXIT["good"]
        print(fitted(f"first failing {args.target} cell: {original.id}"), file=sys.stderr)
    first, second = trials.run(original), trials.run(original)
    if not first.signature.failed:
        verdict = "no divergence" if first.signature.kind == "match" else "not run"  # a skip: nothing was compared
        print(fitted(f"{original.id}: {verdict} ({first.signature})"))
        _write_result(out, {"verdict": verdict, "original": original.id})
        return EXIT["good"] if first.signature.kind == "match" else EXIT["skip"]
    if not trials.same(first, second):
        print(fitted(f"{original.id} is nondeterministic: run 1 gave {first.signature}, run 2 gave {second.signature}"
                     + ("" if first.signature != second.signature else " with results that differ beyond tolerance")
                     + "; not bisected"))
        _write_result(out, {"verdict": "nondeterministic", "original": original.id,
                            "runs": [str(first.signature), str(second.signature)]})
        return EXIT["nondeterministic"]
    target = first.signature
    trials.best = original
    search = Search(original)
    seen = {original: first.signature}  # each config's own signature: the summary names the minimal's

    def holds(cfg: Config):
        trial = trials.run(cfg)
        seen[cfg] = trial.signature
        if trial.signature.kind in ("skip", "invalid"):
            return None
        if target.holds_in(trial.signature):
            trials.best = cfg
            return True
        return False

    try:
        minimal = search.run(holds)
    except Budget:
        trials.best = search.best
        raise
    roles = search.fields()
    seconds = time.monotonic() - started
    own = seen.get(minimal, target)
    result = {"verdict": "divergence", "original": original.id, "minimal": minimal.id, "signature": str(own),
              "original_signature": str(target), "kind": own.kind, "tensors": list(own.tensors), **roles,
              "trials": trials.count,
              "seconds": round(seconds, 2), "reproduce": _reproduce(minimal)}
    place = located(minimal, trials.pool) if trials.pool is not None else None
    if place is not None:
        result["localisation"] = place.as_json()
    slipped = _slipped(original, minimal, place, trials)
    if slipped:
        result["slipped"] = slipped
    _write_result(out, result)
    essential = ", ".join(roles["essential"]) or "none beyond the component itself"
    original_line = "" if minimal == original else f" (the original {original.id}: {target})"
    print("\n" + fitted(f"minimal: {minimal.id} fails with {own}{original_line}; essential: {essential}; "
                        f"{trials.count} trials, {seconds:.1f} s"))
    if place is not None:
        print(place.summary())
    if slipped:
        print(fitted(f"bisect slipped: the minimal config's divergence starts at {slipped['minimal']}, the "
                     f"original's at {slipped['original']}: its signature matches the original's, but it may be "
                     f"another bug; the original as it fails: python -m harness.bisect check {original.id}"))
    print(f"reproduce: {result['reproduce']}")
    return EXIT["bad"]


def _slipped(original: Config, minimal: Config, place, trials: Trials) -> dict | None:
    """``{"original": where, "minimal": where}`` when the minimal config's divergence starts elsewhere
    than the original's (a model's first diverging module and what diverges there, a component's
    event): shrinking met another bug that fails alike. None when they agree or either is unknown."""
    if minimal == original or place is None or not place.start:
        return None
    first = located(original, trials.pool)
    if first is None or not first.start or first.start == place.start:
        return None
    return {"original": first.start, "minimal": place.start}


def _write_result(out: Path, result: dict) -> None:
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    oracle: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, oracle = argv[:at], argv[at + 1:]
    args = _parser().parse_args(argv)
    if oracle and args.command == "run" and "-" not in args.target:
        return _usage("an oracle command needs a config id to start from, not a component")
    try:  # the implementations a conftest registers count only once pytest has loaded it, as it would here
        project = load()
        idle_from_env()  # a bad PARITYTEST_KEEP_POOL is a usage error here, not a traceback at the first trial
    except (ConfigError, KeptPoolError) as error:
        return _usage(str(error))
    if args.command == "check":
        return check(args, project)
    args.oracle = oracle
    return run(args, project)


if __name__ == "__main__":
    sys.exit(main())
