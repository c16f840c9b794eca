"""``python -m harness.zoo transformers``: every shipped plan of the installed transformers, checked
against one process; a table of architecture × plan × mesh. ``python -m harness.zoo torchtitan``:
torchtitan's models, parallelized by its own ``parallelize_fn`` over its own ``ParallelDims``.
``python -m harness.zoo megatron``: Megatron-Core's ``GPTModel`` under its own ``parallel_state``,
``DistributedDataParallel`` and ``finalize_model_grads``.

It runs the zoo's cells (``zoo_cells`` of :mod:`harness.zoo.transformers`, :mod:`harness.zoo.torchtitan`
or :mod:`harness.zoo.megatron`) with pytest in a project of its own in a temporary directory, with the
pool and the junit record every cell run gets, and writes
``zoo.md`` (one row per cell: pass, red with its first line, crash with its cause, skip with its
reason, known or fixed; a framework zoo's models and meshes it cannot run here and its CPU shims, each
with why), ``zoo.html`` (architecture x plan and mesh, coloured) and ``zoo.json`` (the same) under
``--out``. ``python -m harness.zoo diff old/zoo.json new/zoo.json`` says what changed between two releases.
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from html import escape

from pathlib import Path

LIBRARIES = ("transformers", "torchtitan", "megatron")
FRAMEWORKS = ("torchtitan", "megatron")  # zoos of a framework's own models: --meshes, CONFIGS, an install check
TEST = '''\
import pytest

from {module} import zoo_cells

CELLS = zoo_cells(only={only!r} or None, plans={plans!r}{meshes}{imports}){pairwise}


@pytest.mark.parametrize("cfg", CELLS, ids=str)
def test_zoo(cfg, parity):
    parity(cfg)
'''


# --pairwise: the gate's covering design (harness.matrix.covering) of the zoo's cells
PAIRWISE = '''
from harness.matrix import covering

CELLS = covering(CELLS)'''


VERDICTS = ("pass", "red", "crash", "skip", "known", "fixed")
# how a from_pretrained cell's load check fails (harness.examples.pretrained_hf.LoadMismatch): a red
LOAD_CHECK = "LoadMismatch: "
COLOURS = {"pass": "#2e7d32", "red": "#c62828", "crash": "#e65100", "skip": "#9e9e9e", "known": "#1565c0",
           "fixed": "#6a1b9a"}


def rows(junit: Path) -> list[dict]:
    """One row per cell of a zoo run's junit file: its id, verdict and the line that says why:
    ``pass``; ``red`` (where it starts); ``crash`` (its one-line cause); ``skip`` (why); ``known``
    (an upstream divergence declared for this release, :data:`harness.zoo.transformers.KNOWN`, or a
    limit of the tolerance policy that some machines' kernels cross: ``Known(strict=False)``, a pass
    where it matches); ``fixed`` (a strictly declared one that now matches: its entry can go)."""
    from harness.known import headline
    from harness.report.junit import read

    out = []
    for case in read([junit]).cells:
        record = case.record or {}
        status = record.get("status") or case.outcome
        text = case.text or case.message or ""
        reference = "(its reference)" in text.split("\n", 1)[0]
        # a declared bug's cell that failed another way (harness.fixture) is judged as any other cell
        declared = record.get("expected") if record.get("declared") != "differs" else None
        cause = headline(text)
        loaded = LOAD_CHECK in cause  # the load check's own failure: wrong numbers, before any step
        if declared:  # a declaration that holds on some machines' kernels alone passes where it matches
            verdict = "known" if case.outcome == "skipped" else "pass" if record.get("strict") is False else "fixed"
        else:
            verdict = {"passed": "pass", "skipped": "skip"}.get(status) or \
                ("red" if record.get("kind") in ("mismatch", "nan") or loaded else "skip" if reference else "crash")
        why = {"skip": f"its one-process fp64 reference does not run: {cause}" if reference else case.skip_reason,
               "red": (cause[cause.index(LOAD_CHECK):] if loaded else record.get("where")) or "",
               "known": declared or "",
               "fixed": f"declared known ({declared}) but matches now",
               "crash": cause}.get(verdict, "")
        if record.get("declared") == "differs":
            why = f"{why} (not the declared bug, {record['expected']})"
        out.append({"cell": case.cell, "verdict": verdict, "why": why or ""})
    return sorted(out, key=lambda r: r["cell"])


def counts(found: list[dict]) -> str:
    return ", ".join(f"{sum(r['verdict'] == v for r in found)} {v}" for v in VERDICTS)


# what each verdict means, for the page's legend
MEANINGS = {"pass": "matches one process", "red": "diverges: where it starts", "crash": "a rank raised or hung",
            "skip": "not run here: why",
            "known": "a declared upstream bug (or a tolerance limit these kernels cross), failing as declared",
            "fixed": "declared, but matches now: its entry can go"}


def provenance(library: str, seconds: float) -> dict:
    """What a report was made with: the library's, torch's, Python's and the harness's versions (its
    git commit where it runs from a checkout), the date and the run's time."""
    import datetime
    import platform

    import torch

    from harness import versions

    harness = str(versions.harness())
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / ".git").exists():
        commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        harness += f" (commit {commit})" if commit else ""
    return {"library": library, library: _zoo(library).version() or "unknown (no package metadata)",
            "torch": torch.__version__, "python": platform.python_version(), "harness": harness,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "minutes": round(seconds / 60, 1)}


def title(made: dict) -> str:
    """The report's versions line (and, for a ``--pairwise`` run, that it ran the covering design)."""
    library = made.get("library", "transformers")
    line = f"{library} {made.get(library)}, torch {made.get('torch')}"
    extra = [f"Python {made['python']}" if "python" in made else "", made.get("harness", ""), made.get("date", ""),
             f"{made['minutes']} min" if "minutes" in made else "",
             "pairwise: each pair of two axes' values once, not every cell" if made.get("pairwise") else ""]
    return ", ".join([line, *(e for e in extra if e)])


def _imports(args) -> tuple[str, ...]:
    """The modules ``--import`` names, in order (the transformers zoo's option; none elsewhere)."""
    return tuple(m for given in getattr(args, "imports", None) or [] for m in given.split(",") if m)


def reproduce(library: str, cell: str, model: str, imports: tuple[str, ...] = ()) -> str:
    """The command that runs a cell again: its model and plan through the zoo (and its mesh, for
    torchtitan's; the modules it was told to import, for transformers'); for a transformers ``tpauto``
    cell, also the torch-and-transformers-only script, for a Megatron-Core MoE cell under tp with
    ep 1 the torch-and-megatron-core-only one, and for a torchtitan MoE cell whose ep borrows tp's
    ranks the torch-and-torchtitan-only one (qwen3 MoE on tp=2, ep=2)."""
    from harness.config import Config

    cfg = Config.parse(cell)
    plan = "tp" if cfg.impl == "tpfixed" else cfg.impl
    command = f"python -m harness.zoo {library} --only {model} --plans {plan}"
    command += "".join(f" --import {m}" for m in imports)
    if library in FRAMEWORKS:
        command += f" --meshes '{','.join(f'{d}={n}' for d, n in cfg.mesh)}'"
    if library == "transformers" and cfg.impl == "tpauto":
        command += f"; torchrun --nproc-per-node {cfg.degree('tp')} docs/zoo_repro.py {model}"
    switched = dict(cfg.switches)
    if library == "megatron" and "etp" in switched and switched.get("ep") == "1":  # an MoE model under tp
        command += f"; torchrun --nproc-per-node {cfg.degree('tp')} docs/megatron_repro.py --etp {switched['etp']}"
    if library == "torchtitan" and switched.get("ep", "1") != "1" and cfg.degree("tp") > 1:  # ep borrowed from tp
        command += f"; torchrun --nproc-per-node 2 docs/torchtitan_repro.py --sp {switched['sp']}"
    return command


def annotate(found: list[dict], library: str, imports: tuple[str, ...] = (),
             models: list[str] | None = None) -> list[dict]:
    """Each row with its model's own name (``model``: of ``models``, the run's ``--only``, or of every model
    the zoo has) and, where it did not pass, the command that reproduces it (``reproduce``)."""
    zoo = _zoo(library)
    named = {zoo.name_of(m): m for m in models or _models(library)}
    for r in found:
        model = named.get(r["cell"].split("-")[0], r["cell"].split("-")[0])
        r["model"] = model
        if r["verdict"] in ("red", "crash", "known", "fixed"):
            r["reproduce"] = reproduce(library, r["cell"], model, imports)
    return found


UNEXERCISED = ("Plan entries no cell exercises: they name no module or parameter of the tiny build (its config "
               "turns them off, or they name nothing at all), or, marked (no gradient), only parameters that two "
               "steps on one process leave without a gradient (experts no token reaches)")


def unexercised(found: list[dict], library: str) -> dict[str, dict[str, list[str]]]:
    """Per model the zoo ran (a cell of it not skipped), its plans' entries that no cell exercises
    (the library zoo's ``unexercised``; none for a zoo without one)."""
    entries = getattr(_zoo(library), "unexercised", None)
    if entries is None:
        return {}
    ran = sorted({r["model"] for r in found if r["verdict"] != "skip"})
    return {model: missed for model in ran if (missed := entries(model))}


# a framework zoo's tables of what it cannot run here and what it changes for a CPU, by zoo.json's key
LIMITS = {"not_run": ("NOT_RUN", "Not run here"), "shims": ("SHIMS", "CPU shims, none touching the parallel math")}


def limits(library: str) -> dict[str, dict[str, str]]:
    """The zoo's ``NOT_RUN`` and ``SHIMS`` (what -> why) by zoo.json's key, those it has (transformers'
    zoo has neither: what it cannot run is a skipped cell with its reason)."""
    zoo = _zoo(library)
    return {key: dict(table) for key, (name, _) in LIMITS.items() if (table := getattr(zoo, name, None))}


def markdown(found: list[dict], versions: str, library: str = "transformers", unused: dict | None = None,
             limited: dict | None = None) -> str:
    lines = [f"# {library} zoo ({versions})", "", counts(found), "",
             "| cell | verdict | why | reproduce |", "|---|---|---|---|"]
    lines += [f"| `{r['cell']}` | {r['verdict']} | {r['why'].replace('|', '/')} | "
              + (f"`{r['reproduce']}`" if r.get("reproduce") else "") + " |" for r in found]
    if unused:
        lines += ["", f"## {UNEXERCISED}", "", "| model | plan | entries |", "|---|---|---|"]
        lines += [f"| {model} | {plan} | {', '.join(f'`{e}`' for e in missed)} |"
                  for model, plans in unused.items() for plan, missed in plans.items()]
    for key, table in (limited or {}).items():
        lines += ["", f"## {LIMITS[key][1]}", "", "| what | why |", "|---|---|"]
        lines += [f"| {what} | {why.replace('|', '/')} |" for what, why in table.items()]
    return "\n".join(lines) + "\n"


def html(found: list[dict], versions: str, library: str = "transformers", unused: dict | None = None,
         limited: dict | None = None) -> str:
    """Model x (plan, mesh), each square coloured by its verdict; a legend; below, every cell that did
    not pass with its line and the command that reproduces it. A plan an architecture does not ship
    (no EP plan) reads ``not shipped``; a square of no cell at all, blank (not run)."""
    grid: dict[str, dict[str, dict]] = {}
    for r in found:
        _, impl, mesh = r["cell"].split("-")[:3]
        grid.setdefault(r.get("model") or r["cell"].split("-")[0], {})[f"{impl} {mesh}"] = r
    columns = sorted({c for by in grid.values() for c in by})
    shipped_only = set(getattr(_zoo(library), "PLANS", ())) if library == "transformers" else set()
    head = "".join(f"<th>{escape(c)}</th>" for c in columns)
    body = []
    for model in sorted(grid):
        squares = []
        for c in columns:
            r = grid[model].get(c)
            if r is None:
                squares.append('<td class="none">not shipped</td>' if c.split()[0] in shipped_only else "<td></td>")
            else:
                squares.append(f'<td style="background:{COLOURS[r["verdict"]]}" title="{escape(r["why"])}">'
                               f'{r["verdict"]}</td>')
        body.append(f"<tr><th>{escape(model)}</th>{''.join(squares)}</tr>")
    legend = "".join(f'<span style="background:{COLOURS[v]}" class="key">{v}</span> {escape(MEANINGS[v])} '
                     for v in VERDICTS)
    notes = "".join(f"<tr><td><code>{escape(r['cell'])}</code></td><td>{r['verdict']}</td><td>{escape(r['why'])}</td>"
                    f"<td><code>{escape(r.get('reproduce', ''))}</code></td></tr>"
                    for r in found if r["verdict"] not in ("pass", "skip"))
    skips = "".join(f"<tr><td><code>{escape(r['cell'])}</code></td><td>{escape(r['why'])}</td></tr>"
                    for r in found if r["verdict"] == "skip")
    return (f"<!doctype html><meta charset='utf-8'><title>{library} zoo</title><style>body{{font-family:sans-serif}}"
            f"td{{font-size:12px;padding:2px 6px}}td[style]{{color:white;text-align:center}}th{{font-size:12px;"
            f"text-align:left}}td.none{{color:#9e9e9e;text-align:center}}.key{{color:white;padding:1px 6px}}</style>"
            f"<h1>{library} zoo</h1><p>{escape(versions)}</p><p>{counts(found)}</p><p>{legend}</p>"
            f"<table><tr><th></th>{head}</tr>{''.join(body)}</table>"
            f"<h2>Not passing</h2><table><tr><th>cell</th><th>verdict</th><th>why</th><th>reproduce</th></tr>{notes}"
            f"</table><h2>Skipped</h2><table><tr><th>cell</th><th>why</th></tr>{skips}</table>"
            + (f"<h2>{escape(UNEXERCISED)}</h2><table><tr><th>model</th><th>plan</th><th>entries</th></tr>"
               + "".join(f"<tr><td>{escape(model)}</td><td>{plan}</td>"
                         f"<td><code>{escape(', '.join(missed))}</code></td></tr>"
                         for model, plans in unused.items() for plan, missed in plans.items()) + "</table>"
               if unused else "")
            + "".join(f"<h2>{escape(LIMITS[key][1])}</h2><table><tr><th>what</th><th>why</th></tr>"
                      + "".join(f"<tr><td>{escape(what)}</td><td>{escape(why)}</td></tr>"
                                for what, why in table.items())
                      + "</table>" for key, table in (limited or {}).items()))


def changes(old: dict, new: dict, library: str) -> tuple[list[str], list[str]]:
    """What changed between two zoo.json files, one line per cell: its verdict moved, or it kept its
    verdict for another reason (a skip's cause, a red's first line, a crash's cause); and the cells
    known on both whose declared bug is the same (its reason but for the release it names): they
    still hold, said once for all of them, not as a change (``library``: whose releases they name)."""
    before = {r["cell"]: r for r in old["cells"]}
    after = {r["cell"]: r for r in new["cells"]}
    out, held = [], []
    for cell in sorted(set(before) | set(after)):
        a, b = before.get(cell), after.get(cell)
        if a is None or b is None or a["verdict"] != b["verdict"]:
            out.append(f"{cell}: {a['verdict'] if a else 'absent'} -> {b['verdict'] if b else 'absent'}"
                       + (f" ({b['why']})" if b and b["why"] else ""))
        elif b["verdict"] == "known" and _declared(a["why"], library) == _declared(b["why"], library):
            held.append(cell)
        elif a["why"] != b["why"]:
            out.append(f"{cell}: {b['verdict']}, another reason: {a['why'] or '(none)'} -> {b['why'] or '(none)'}")
    return out, held


def _declared(why: str, library: str) -> str:
    """A known cell's reason without the release it starts with (``transformers 5.24.0, a release it
    has not been seen on yet (seen on 5.23.0): ...``): the declared bug itself."""
    return why.split(": ", 1)[1] if why.startswith(f"{library} ") and ": " in why else why


def _models(library: str) -> list[str]:
    """What ``--only`` may name: a framework zoo's models, or transformers' model types with a plan."""
    zoo = _zoo(library)
    return list(zoo.CONFIGS) if library in FRAMEWORKS else zoo.architectures()


def _unknown(library: str, only: list[str]) -> list[str]:
    """Those of ``only`` that ``--only`` may not name (:func:`_models`), each model type checked alone."""
    zoo = _zoo(library)
    return [m for m in only if m not in zoo.CONFIGS] if library in FRAMEWORKS else [
        m for m in only if not zoo.has_plan(m)]


def _zoo(library: str):
    """The zoo module of ``library`` (its ``PLANS``, ``zoo_cells``, ``version``): the glue for its installed
    release where the zoo has one per release (``glue()``)."""
    module = importlib.import_module(f"harness.zoo.{library}")
    return module.glue() if hasattr(module, "glue") else module


def run(args) -> int:
    library = args.command
    zoo = _zoo(library)
    if library in FRAMEWORKS:
        from harness.zoo import ZooMissing

        try:
            zoo._shim()
        except ZooMissing as error:
            print(f"python -m harness.zoo {library}: {error}", file=sys.stderr)
            return 2
    only = [m for m in args.only.split(",") if m]
    plans = tuple(p for p in args.plans.split(",") if p) or tuple(zoo.PLANS)
    meshes = tuple(m for given in getattr(args, "meshes", None) or [] for m in given.split(";") if m)
    try:  # meshes on which the models asked for run nothing: one line here, not a collection error in the run
        if meshes:
            zoo.zoo_cells(only or None, plans, meshes=meshes)
    except ValueError as error:
        print(f"python -m harness.zoo {library}: {error}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    junit = (args.out / "junit.xml").resolve()
    with tempfile.TemporaryDirectory(prefix="harness-zoo-") as project:
        imports = _imports(args)
        (Path(project) / "test_zoo.py").write_text(TEST.format(
            module=zoo.__name__, only=only, plans=plans, meshes=f", meshes={meshes!r}" if meshes else "",
            imports=f", imports={imports!r}" if imports else "", pairwise=PAIRWISE if args.pairwise else ""))
        (Path(project) / "pytest.ini").write_text("[pytest]\n")
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", args.n,
                   f"--junitxml={junit}", "--case-deadline", "300", "test_zoo.py"]
        started = time.monotonic()
        env = os.environ.copy()
        if imports:  # the user's modules, from where the user runs the zoo
            env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), *filter(None, [env.get("PYTHONPATH")])])
        done = subprocess.run(command, cwd=project, env=env)
    found = annotate(rows(junit), library, imports, only) if junit.exists() else []
    if done.returncode not in (0, 1) or not found:
        print(f"the zoo's pytest run ended with {done.returncode} and judged no cell (its output is above)",
              file=sys.stderr)
        return 2
    made = provenance(library, time.monotonic() - started) | ({"pairwise": True} if args.pairwise else {})
    unused, limited = unexercised(found, library), limits(library)
    versions = title(made)
    (args.out / "zoo.json").write_text(json.dumps(made | {"cells": found, "unexercised": unused} | limited, indent=1))
    (args.out / "zoo.md").write_text(markdown(found, versions, library, unused, limited))
    (args.out / "zoo.html").write_text(html(found, versions, library, unused, limited))
    print(f"zoo ({versions}): {counts(found)}: {args.out / 'zoo.md'}, zoo.html, zoo.json")
    return 0


def diff(args) -> int:
    try:
        old, new = (json.loads(Path(p).read_text()) for p in (args.old, args.new))
    except (OSError, ValueError) as error:
        print(f"python -m harness.zoo diff: {error}: give two zoo.json files that python -m harness.zoo wrote",
              file=sys.stderr)
        return 2
    library = new.get("library", "transformers")  # zoo.json files written before torchtitan's zoo name none
    moved, held = changes(old, new, library)
    print(f"{library} {old.get(library)} -> {new.get(library)}: {len(moved)} cells changed")
    print("\n".join(moved))
    if held:
        models = sorted({cell.split("-")[0] for cell in held})
        print(f"still known, the same declared bug: {len(held)} cells of {len(models)} model(s) ({', '.join(models)})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.zoo", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    helps = {"transformers": ("check every architecture's shipped plans", "model types", "tp, tpauto, ep, tpep"),
             "torchtitan": ("check torchtitan's models under its own parallelize_fn", "models (llama3, qwen3)",
                            "its DTensor backends, partial and full"),
             "megatron": ("check Megatron-Core's GPTModel under its own parallel_state, DDP and finalize_model_grads",
                          "models (gpt, qknorm, moe, moeshared)", "ddp")}
    zoos = {}
    for library in LIBRARIES:
        what, only, plans = helps[library]
        zoo = zoos[library] = sub.add_parser(library, help=what)
        zoo.add_argument("--only", default="", help=f"{only}, comma separated (default: every one)")
        zoo.add_argument("--plans", default="", help=f"of {plans} (default: all)")
        zoo.add_argument("--out", type=Path, default=Path("zoo-out"), help="where zoo.md, zoo.html and zoo.json go")
        zoo.add_argument("-n", default="auto", help="pytest-xdist workers (default: auto)")
        zoo.add_argument("--pairwise", action="store_true",
                         help="of each model, plan and mesh only the cells in which every pair of two axes' values "
                              "(dtype, schedule, sequence parallel, dispatcher, ep, ...) meets once, as the gate's "
                              "covering designs (default: every cell)")
        if library == "transformers":
            zoo.add_argument("--import", dest="imports", action="append", metavar="MODULE",
                             help="a module of yours that registers model types of your own with transformers' "
                                  "auto classes (and their conversion mappings), imported first: the zoo runs "
                                  "them as it runs transformers' own; ',' between them or the option repeated")
        if library in FRAMEWORKS:
            zoo.add_argument("--meshes", action="append", help="meshes, ';' between them or the option repeated, "
                                                                "e.g. 'dp=2;dp=2,tp=2' (default: every one the zoo runs)")
    compared = sub.add_parser("diff", help="what changed between two zoo.json files (two releases)")
    compared.add_argument("old", type=Path)
    compared.add_argument("new", type=Path)
    args = parser.parse_args(argv)
    if args.command == "diff":
        return diff(args)
    for module in _imports(args):  # before the model types are read: theirs are among them
        try:
            importlib.import_module(module)
        except Exception as error:  # noqa: BLE001  the user's module: whatever it raises is the line
            zoos[args.command].error(f"--import {module}: {type(error).__name__}: {error} (give a module importable "
                                     "from this directory or installed, e.g. --import mypkg.zoo_models)")
    # each model --only names is checked alone; every model type is read only to word the error
    # (transformers': every config class imported, seconds)
    only = [m for m in args.only.split(",") if m]
    if bad := _unknown(args.command, only):
        models = _models(args.command)
        near = {m: difflib.get_close_matches(m, models, n=1) for m in bad}
        zoos[args.command].error(
            "--only: unknown " + ", ".join(f"{m} (did you mean {near[m][0]}?)" if near[m] else m for m in bad)
            + (f"; give some of {', '.join(models)}" if len(models) <= 12 else
               f"; {len(models)} model types ship a TP or EP plan here"))
    known = _zoo(args.command).PLANS
    if bad := [p for p in args.plans.split(",") if p and p not in known]:
        zoos[args.command].error(f"--plans: unknown {', '.join(bad)}; give some of {', '.join(known)}")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
