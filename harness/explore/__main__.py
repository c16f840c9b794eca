"""Command line of ``python -m harness.explore`` (see the package docstring, or ``--help``)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..config import ConfigError
from ..pool.defaults import DEFAULT_DEADLINE, DEFAULT_SIZE
from ..pool.kept import KeptPoolError, idle_from_env
from ..project import Project, load
from ..registry import COMPONENTS, get
from . import __doc__ as DOC

# the pool and the search (torch, hypothesis) are imported once the command line has been checked:
# --help and a usage error answer at once

EXIT = {"nothing": 0, "found": 1, "usage": 2}
EPILOG = """exit codes:
  0    nothing found within the budget
  1    a divergence found: the minimal config, the command that reproduces it and the line that adds
       it to the matrix are printed, and written to result.json
  2    usage error: an unknown component or implementation, a bad option
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m harness.explore", description=DOC, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("targets", nargs="+", metavar="<component>[:<impl>]",
                        help="what to explore: a component (every implementation of it), one implementation "
                             "(tp:ours), or 'all'")
    parser.add_argument("--max-examples", type=int, default=100,
                        help="configs hypothesis draws per target at most (default 100)")
    parser.add_argument("--max-seconds", type=float, default=300.0,
                        help="seconds of search per target at most (default 300)")
    parser.add_argument("--shrink-seconds", type=float, default=120.0,
                        help="seconds of shrinking once a divergence is found: half for hypothesis's shrinker, the rest "
                             "for bisect's field-by-field search (default 120)")
    parser.add_argument("--database", default=None,
                        help="hypothesis's example database (default: .hypothesis/explore in the project's "
                             "rootdir, as pytest finds it from here); 'none' for none")
    parser.add_argument("--ignore", action="append", default=[], metavar="TENSOR",
                        help="a result tensor whose divergence alone does not count (repeatable; 'loss' also covers "
                             "'resumed/loss'), for one already known and declared, e.g. --ignore loss")
    parser.add_argument("--seed", type=int, default=None,
                        help="draw the same configs in every run (default: new ones each run); for a reproducible "
                             "search, e.g. a test that a planted bug is found within --max-examples; a seeded run stores "
                             "nothing in the example database")
    parser.add_argument("--out", default="explore-out", help="where result.json and trials.jsonl go (default explore-out)")
    parser.add_argument("--pool-size", type=int, default=DEFAULT_SIZE, help=f"rank processes (default {DEFAULT_SIZE})")
    parser.add_argument("--case-deadline", type=float, default=DEFAULT_DEADLINE,
                        help=f"seconds per trial before it counts as a hang (default {DEFAULT_DEADLINE:g})")
    return parser


def _usage(message: str) -> int:
    print(f"python -m harness.explore: error: {message}", file=sys.stderr)
    return EXIT["usage"]


def targets(names: list[str], project: Project | None = None) -> list[tuple[str, str]]:
    """``tp``, ``tp:ours`` or ``all`` -> (component, implementation) pairs; unknown ones raise,
    naming where pytest looked when ``project`` is given."""
    out: list[tuple[str, str]] = []
    for name in names:
        if name == "all":
            get("tp")  # registers the built-in components
            out += [(c.name, i) for c in COMPONENTS.values() if c.space is not None for i in c.implementations]
            continue
        component, _, impl = name.partition(":")
        comp = project.component(component) if project else get(component)
        if comp.space is None:
            raise ConfigError(f"component {component!r} declares no exploration space: add "
                              "space=Space(dims=..., sizes=..., switches=...) to its register_component(...)")
        if impl and impl not in comp.implementations:
            where = f"; {project.where()}" if project else ""
            raise ConfigError(f"no implementation {impl!r} of {component}; registered: "
                              f"{', '.join(sorted(comp.implementations))}{where}")
        out += [(component, impl)] if impl else [(component, i) for i in comp.implementations]
    return list(dict.fromkeys(out))


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.max_examples < 1 or not args.max_seconds > 0 or not args.shrink_seconds > 0:
        return _usage("--max-examples needs at least 1, --max-seconds and --shrink-seconds a positive number")
    if args.pool_size < 1 or not args.case_deadline > 0:
        return _usage("--pool-size needs at least 1 and --case-deadline a positive number of seconds")
    try:
        project = load(Path.cwd())  # registrations in the conftest.py files here count
        chosen = targets(args.targets, project)
        keep = idle_from_env()  # PARITYTEST_KEEP_POOL: the project's kept pool, as pytest's
    except (ConfigError, KeptPoolError) as error:
        return _usage(str(error))
    from ..pool.parent import preloads, shared_pool
    from .runner import DATABASE, Budget, Exploration, explore, write_result

    db_path = project.rootdir / DATABASE if args.database is None else None if args.database == "none" else Path(args.database)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.max_examples, args.max_seconds, args.shrink_seconds)
    # its zygotes import the targets' modules, not every registered one's (transformers, Megatron-Core)
    pool = shared_pool(size=args.pool_size, deadline=args.case_deadline, keep=keep, root=str(project.rootdir),
                       **preloads(chosen))
    results: list[Exploration] = []
    try:
        with open(out / "trials.jsonl", "w") as log:
            for component, impl in chosen:
                if db_path is not None:
                    db_path.mkdir(parents=True, exist_ok=True)
                found = explore(component, impl, pool, budget, db_path=db_path, log=log, ignore=tuple(args.ignore),
                                seed=args.seed)
                results.append(found)
                write_result(out, results)
                print("\n" + found.summary(str(db_path), []),
                      file=sys.stdout if found.minimal else sys.stderr)
    finally:
        pool.close()
    bad = [r for r in results if r.minimal is not None]
    print(f"explored {len(results)} target(s): {len(bad)} diverged"
          + "".join(f"; {r.target}: {r.minimal.id}" for r in bad) + f"; details in {out / 'result.json'}")
    return EXIT["found"] if bad else EXIT["nothing"]


if __name__ == "__main__":
    sys.exit(main())
