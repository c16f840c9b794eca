"""One PNG per component: worst err/tol over mesh x (dtype, switches), failures marked.

Read in five seconds: green is far inside the tolerance, yellow close to it, a red square with a
cross failed (its err/tol written in it), grey hatched was skipped, white is not in the matrix. One
panel per implementation, rows are meshes (smallest world first), columns are dtype then the
switch values; problem sizes of one (mesh, dtype, switches) are folded into their worst.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import matplotlib

matplotlib.use("Agg")  # headless: CI runners and rank-less report runs have no display

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import LinearSegmentedColormap, LogNorm  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

DTYPE_ORDER = {"fp64": 0, "fp32": 1, "bf16": 2, "fp16": 3}
FAIL = "#d7191c"
SKIP = "#d9d9d9"
# err/tol from 1e-4 (dark green) to 1 (yellow): red stays reserved for failures
PASS_CMAP = LinearSegmentedColormap.from_list("pass", ["#1a7837", "#5aae61", "#d9f0a3", "#ffe45c"])
LOW, HIGH = 1e-4, 1.0
BARE = {"on", "off", "true", "false", "yes", "no", "none"}


@dataclass
class Grid:
    """The heatmap of one component: per implementation a matrix of worst err/tol and marks."""

    component: str
    impls: list[str]
    meshes: list[str]  # rows
    columns: list[tuple[str, tuple]]  # (dtype, ((switch, value), ...))
    ratio: dict[tuple[str, str, int], float] = field(default_factory=dict)  # (impl, mesh, col) -> worst
    status: dict[tuple[str, str, int], str] = field(default_factory=dict)  # failed / passed / skipped
    cells: dict[tuple[str, str, int], list[str]] = field(default_factory=dict)  # which cells fold there
    counts: Counter = field(default_factory=Counter)  # cells by status
    kinds: dict[tuple[str, str, int], str] = field(default_factory=dict)  # how a red square failed

    def failed(self) -> list[tuple[str, str, int]]:
        return sorted(k for k, s in self.status.items() if s == "failed")

    @property
    def switch_keys(self) -> list[str]:
        return sorted({k for _, sw in self.columns for k, _ in sw})

    def column_label(self, col: int) -> str:
        """dtype and switch values; a value that means nothing alone (on, off, ...) keeps its key."""
        dtype, switches = self.columns[col]
        return " ".join([dtype] + [f"{k}_{v}" if v in BARE or v.isdigit() else v for k, v in switches])


def _short(ratio: float) -> str:
    """err/tol in at most 4 characters: 4.2, 72, 6e5."""
    if ratio < 100:
        return f"{ratio:.2g}"
    return f"{ratio:.0e}".replace("e+0", "e").replace("e+", "e")


def _mesh_key(mesh: str) -> tuple:
    world = math.prod(int("".join(ch for ch in part if ch.isdigit()) or 1) for part in mesh.split("."))
    return world, mesh


def grid(component: str, records: list[dict]) -> Grid:
    """Fold the ``parity`` records of one component's cells into a :class:`Grid`."""
    columns = sorted({(r["dtype"], tuple(sorted(r["switches"].items()))) for r in records},
                     key=lambda c: (DTYPE_ORDER.get(c[0], 9), c[0], c[1]))
    out = Grid(component, sorted({r["impl"] for r in records}), sorted({r["mesh"] for r in records}, key=_mesh_key),
               columns)
    index = {c: i for i, c in enumerate(columns)}
    rank = {"passed": 0, "skipped": -1, "failed": 1}
    for r in records:
        key = (r["impl"], r["mesh"], index[(r["dtype"], tuple(sorted(r["switches"].items())))])
        status = r["status"] if r["status"] in rank else "failed"
        out.cells.setdefault(key, []).append(r["cell"])
        out.counts[status] += 1
        previous = out.status.get(key)
        if previous is None or rank[status] > rank[previous]:  # a square is as bad as its worst cell
            out.status[key] = status
        if status == "failed":
            out.kinds.setdefault(key, r.get("kind") or "error")
        if status != "skipped":
            out.ratio[key] = max(out.ratio.get(key, 0.0), float(r.get("ratio") or 0.0))
    return out


def render(g: Grid, path, dpi: int = 100) -> dict[tuple[str, str, int], tuple[float, float]]:
    """Draw ``g`` to ``path`` (PNG). Returns each grid square's centre in image pixels (x, y from
    the top left), so a test can look at the colour the reader sees there."""
    ncols, nrows = len(g.columns), len(g.meshes)
    width = max(6.0, 1.6 + 0.36 * ncols)
    panel_h = max(0.5 + 0.3 * nrows, 1.8 / len(g.impls))  # room for the legend above the colour bar
    label_h = 0.3 + 0.042 * max(len(g.column_label(i)) for i in range(ncols))  # 60° rotated 7.5 pt text
    fig = plt.figure(figsize=(width, 1.3 + panel_h * len(g.impls) + label_h), dpi=dpi)
    top, bottom = 1 - 1.0 / fig.get_figheight(), (label_h + 0.15) / fig.get_figheight()
    step = (top - bottom) / len(g.impls)
    left, right = 1.1 / width, 1 - 1.3 / width
    norm = LogNorm(LOW, HIGH)
    centres = {}
    failed = g.failed()
    n_cells = sum(len(v) for v in g.cells.values())
    n_failed, n_skipped = g.counts["failed"], g.counts["skipped"]
    worst = max((r for k, r in g.ratio.items() if g.status[k] == "passed"), default=0.0)
    headline = (f"{g.component}: {n_failed} of {n_cells} cells FAILED (red ✗)" if failed
                else f"{g.component}: all {n_cells - n_skipped} cells that ran pass (worst err/tol {worst:.2g})")
    fig.suptitle(headline, x=0.02, ha="left", fontsize=13, fontweight="bold", color=FAIL if failed else "black")
    fig.text(0.02, 1 - 0.62 / fig.get_figheight(),
             "worst err/tol per mesh × (dtype, switches); ≥ 1 fails · sizes folded into their worst"
             + (f" · {n_skipped} cells skipped" if n_skipped else ""),
             fontsize=8.5, color="#444444")
    image = None
    for p, impl in enumerate(g.impls):
        ax = fig.add_axes((left, top - (p + 1) * step + 0.12 * step, right - left, step * 0.8))
        values = np.full((nrows, ncols), np.nan)
        for (i, mesh, col), ratio in g.ratio.items():
            if i == impl and g.status.get((i, mesh, col)) == "passed":
                values[g.meshes.index(mesh), col] = min(max(ratio, LOW), HIGH)
        image = ax.imshow(values, cmap=PASS_CMAP, norm=norm, aspect="auto", interpolation="nearest")
        for (i, mesh, col), status in g.status.items():
            if i != impl:
                continue
            row = g.meshes.index(mesh)
            if status == "failed":
                ax.add_patch(Rectangle((col - 0.5, row - 0.5), 1, 1, facecolor=FAIL, edgecolor="black", lw=1.2))
                ratio = g.ratio.get((i, mesh, col), math.inf)
                # a crash or hang has no err/tol: the square says which it was
                text = f"✗\n{g.kinds.get((i, mesh, col), '')[:5]}" if not math.isfinite(ratio) or ratio == 0 \
                    else f"✗\n{_short(ratio)}"
                ax.text(col, row, text, ha="center", va="center", color="white", fontsize=7, fontweight="bold",
                        linespacing=0.9)
            elif status == "skipped":
                ax.add_patch(Rectangle((col - 0.5, row - 0.5), 1, 1, facecolor=SKIP, edgecolor="white",
                                       hatch="///", lw=0))
        for col in range(1, ncols):  # a heavier line where the dtype changes: the columns' first grouping
            if g.columns[col][0] != g.columns[col - 1][0]:
                ax.axvline(col - 0.5, color="#333333", lw=2)
        ax.set_yticks(range(nrows), g.meshes, fontsize=8)
        ax.set_xticks(range(ncols), [g.column_label(c) for c in range(ncols)] if p == len(g.impls) - 1 else [],
                      rotation=60, ha="right", rotation_mode="anchor", fontsize=7.5)
        ax.set_xticks(np.arange(-0.5, ncols), minor=True)
        ax.set_yticks(np.arange(-0.5, nrows), minor=True)
        ax.grid(which="minor", color="white", lw=0.8)
        ax.tick_params(which="minor", length=0)
        bad = sum(1 for k in failed if k[0] == impl)
        ax.set_title(f"impl {impl}" + (f"  —  {bad} red" if bad else ""), loc="left", fontsize=10,
                     color=FAIL if bad else "black", fontweight="bold" if bad else "normal")
        ax.set_ylabel("mesh", fontsize=8)
        for (i, mesh, col) in g.status:
            if i == impl:
                x, y = ax.transData.transform((col, g.meshes.index(mesh)))
                centres[(i, mesh, col)] = (float(x), float(fig.get_figheight() * dpi - y))
    if g.switch_keys:
        fig.text(0.02, 0.15 / fig.get_figheight(), f"columns: dtype, then {', '.join(g.switch_keys)}",
                 fontsize=8, color="#444444")
    figh = fig.get_figheight()
    cax = fig.add_axes((right + 0.25 / width, bottom + 0.1 / figh, 0.18 / width, top - bottom - 0.85 / figh))
    bar = fig.colorbar(image, cax=cax)
    bar.set_label("err/tol (passed)", fontsize=8)
    bar.ax.tick_params(labelsize=7)
    fig.legend(handles=[Patch(facecolor=FAIL, edgecolor="black", label="✗ failed"),
                        Patch(facecolor=SKIP, hatch="///", edgecolor="white", label="skipped"),
                        Patch(facecolor="white", edgecolor="#999999", label="not in matrix")],
               loc="upper right", bbox_to_anchor=(0.995, top + 0.02), fontsize=7.5, frameon=False)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return centres
