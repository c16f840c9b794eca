"""Figures of whole-model cells (``record["model"]``, :mod:`harness.model.diagnose`).

* ``losses-<model>.png``: the loss of every step, the one-process reference (black, one line per
  dtype: each dtype starts from its own rounded weights) and each cell's run on its mesh (one
  coloured line per cell; a failing cell dashed red, marked ✗ in the legend); below it, each cell's
  difference from its reference per step (``run - reference``, :func:`loss_gaps`), where curves that
  coincide above part visibly.
* ``modules-<cell id>.png``, for a failing cell: a module × step heatmap of err/tol from the hooks'
  events (rows the modules in the order the reference ran them, columns each step's forward output
  and backward input gradient): green passes, red fails, the first red square — the first
  diverging module — outlined; grey was not compared.
"""
from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")  # headless

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import LinearSegmentedColormap, LogNorm  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from .heatmap import FAIL, SKIP, _short  # noqa: E402

# err/tol: green far inside, yellow near 1, red beyond (the whole scale, unlike the matrix heatmap,
# because here the colour of a failing square says how far past the tolerance a module is)
MODULE_CMAP = LinearSegmentedColormap.from_list(
    "modules", [(0.0, "#1a7837"), (0.45, "#d9f0a3"), (0.5, "#ffe45c"), (0.55, "#fc8d59"), (1.0, "#7f0000")])
LOW, HIGH = 1e-4, 1e4
# passing runs' lines: no red, which marks the failing ones
RUN_COLOURS = ["#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]


def model_records(records: list[dict]) -> list[dict]:
    """The records that carry model data (model cells that ran)."""
    return [r for r in records if r.get("model", {}).get("losses", {}).get("run")]


def loss_gaps(records: list[dict]) -> dict[str, list[float]]:
    """Each cell's loss minus its reference's, per step: the difference the loss plot's curves hide."""
    return {r["cell"]: [run - ref for run, ref in zip(r["model"]["losses"]["run"], r["model"]["losses"]["reference"])]
            for r in records}


def _label(r: dict) -> str:
    switches = f" {' '.join(f'{k}_{v}' for k, v in sorted(r['switches'].items()))}" if r["switches"] else ""
    return ("✗ " if r["status"] == "failed" else "") + f"{r['impl']} {r['mesh']} {r['dtype']}{switches}"


def plot_losses(model: str, records: list[dict], path) -> None:
    """Two panels: the reference's loss per step and each cell's; below, each cell's difference from
    its reference per step."""
    fig, (ax, below) = plt.subplots(2, 1, figsize=(7.5, 6.4), dpi=100, sharex=True,
                                    gridspec_kw={"height_ratios": [3, 2]})
    seen = set()
    for r in sorted(records, key=lambda r: r["dtype"]):
        ref = r["model"]["losses"]["reference"]
        if r["dtype"] not in seen:
            seen.add(r["dtype"])
            ax.plot(range(1, len(ref) + 1), ref, color="black", lw=3, alpha=0.35,
                    label=f"reference (one process, fp64) from {r['dtype']} weights")
    colours, gaps = RUN_COLOURS, loss_gaps(records)
    for i, r in enumerate(sorted(records, key=lambda r: r["cell"])):
        run = r["model"]["losses"]["run"]
        failed = r["status"] == "failed"
        style = dict(marker="x" if failed else "o", ms=5, ls="--" if failed else "-", lw=1.2,
                     color=FAIL if failed else colours[i % len(colours)])
        ax.plot(range(1, len(run) + 1), run, label=_label(r), **style)
        below.plot(range(1, len(run) + 1), gaps[r["cell"]], **style)
    steps = max(len(r["model"]["losses"]["run"]) for r in records)
    below.set_xticks(range(1, steps + 1))
    below.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    below.set_ylabel("run − reference")
    below.axhline(0.0, color="black", lw=1, alpha=0.35)
    below.grid(alpha=0.3)
    bad = sum(r["status"] == "failed" for r in records)
    ax.set_title(f"{model}: loss per step, reference and every mesh" + (f" — {bad} failing" if bad else ""),
                 loc="left", fontsize=11, color=FAIL if bad else "black")
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def module_grid(record: dict) -> tuple[list[str], list[tuple[int, str]], np.ndarray]:
    """Rows (modules, in the reference's order), columns ((step, phase)), err/tol (nan: not compared).
    A module called several times in a step (microbatches) is folded into its worst."""
    events = record["model"].get("modules") or []
    modules = list(dict.fromkeys(e[0] for e in events))
    columns = sorted({(e[2], e[1]) for e in events}, key=lambda c: (c[0], c[1] != "fwd"))
    values = np.full((len(modules), len(columns)), np.nan)
    for module, phase, step, ratio in events:
        if ratio is None:
            continue
        i, j = modules.index(module), columns.index((step, phase))
        values[i, j] = ratio if math.isnan(values[i, j]) else max(values[i, j], ratio)
    return modules, columns, values


def first_diverging(record: dict, modules: list[str], columns: list[tuple[int, str]],
                    values: np.ndarray) -> tuple[int, int] | None:
    """The (row, column) of the module the cell's diagnosis names (``record["model"]["first"]``,
    the line pytest, bisect and exploration print) at step 1; None where it names none. A record
    written before diagnoses named theirs: the first event past its tolerance, in the order the
    run made them (steps in order, within a step the forward top to bottom, then the backward
    bottom to top)."""
    named = record["model"].get("first")
    if named is not None:
        module, phase = named
        step = min((s for s, p in columns if p == phase), default=None)
        if module in modules and step is not None:
            return modules.index(module), columns.index((step, phase))
        return None
    if "where" in record:
        return None
    for j, (_, phase) in enumerate(columns):
        rows = range(len(modules)) if phase == "fwd" else reversed(range(len(modules)))
        for i in rows:
            if values[i, j] > 1:
                return i, j
    return None


def plot_modules(record: dict, path) -> tuple[int, int] | None:
    """The module × step heatmap of one failing cell; returns the outlined first diverging square."""
    modules, columns, values = module_grid(record)
    fig_h = 1.6 + 0.22 * len(modules)
    fig, ax = plt.subplots(figsize=(max(5.0, 3.2 + 0.7 * len(columns)), fig_h), dpi=100)
    shown = np.clip(values, LOW, HIGH)
    ax.imshow(np.where(np.isnan(values), np.nan, shown), cmap=MODULE_CMAP, norm=LogNorm(LOW, HIGH), aspect="auto",
              interpolation="nearest")
    for i, j in zip(*np.where(np.isnan(values))):
        ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor=SKIP, edgecolor="white", hatch="///", lw=0))
    for i, j in zip(*np.where(values > 1)):
        ax.text(j, i, _short(float(values[i, j])), ha="center", va="center", fontsize=6, color="white")
    first = first_diverging(record, modules, columns, values)
    if first is not None:
        i, j = first
        ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="black", lw=2.5))
    ax.set_yticks(range(len(modules)), modules, fontsize=7)
    ax.set_xticks(range(len(columns)), [f"step {s}\n{'output' if p == 'fwd' else 'input grad'}" for s, p in columns],
                  fontsize=7)
    ax.xaxis.tick_top()
    title = f"{record['cell']}: err/tol per module and step"
    where = record.get("where", "")
    if where.startswith("first diverging module:"):  # the diagnosis's line, up to what it says of the module
        title += "\n" + ": ".join(where.split(": ")[:2])
    elif first is not None:
        what = "output" if columns[first[1]][1] == "fwd" else "input gradient"
        title += f"\nfirst diverging: {modules[first[0]]} ({what}, step {columns[first[1]][0]})"
    ax.set_title(title, fontsize=8.5, loc="left", color=FAIL, pad=28)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return first


def write_figures(components: dict[str, list[dict]], out) -> dict[str, object]:
    """Every model's loss plot and every failing model cell's module heatmap under ``out``: {name: path}."""
    paths = {}
    for model, records in components.items():
        ran = model_records(records)
        if not ran:
            continue
        paths[f"losses-{model}"] = out / f"losses-{model}.png"
        plot_losses(model, ran, paths[f"losses-{model}"])
        for r in ran:
            if r["status"] == "failed" and r["model"].get("modules"):
                paths[f"modules-{r['cell']}"] = out / f"modules-{r['cell']}.png"
                plot_modules(r, paths[f"modules-{r['cell']}"])
    return paths
