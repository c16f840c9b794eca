"""docs/implementations.md's table of what each built-in component expects back, held to the references.

The table (section "What each built-in component expects back") is what a user writing an outside
implementation reads instead of ``harness/parallel/<c>.py``; this test parses it and runs the reference of
a config of every component (every ``tp`` op, both ``tied`` of ``pp``, both ``aux`` of ``moe``), so a
result renamed, added or reshaped in a reference fails here until the page says so.
"""
from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import torch

from harness.config import Config
from harness.registry import get, reference_of
from reference import checkpoint, fsdp, moe, pipeline, ring_attention, tp

PAGE = Path(__file__).resolve().parent.parent / "docs" / "implementations.md"
SECTION = "## What each built-in component expects back"
BUILT_IN = ("tp", "ringattn", "moe", "pp", "fsdp", "ckpt")


def _configs() -> list[Config]:
    one = {"w": 1}
    out = [Config("tp", "ours", one, "fp32", tp.SIZES, {"op": op}) for op in tp.OPS]
    out += [Config("ringattn", "ours", one, "fp32", dict(ring_attention.SIZES, s=8),
                   {"gqa": gqa, "layout": "contig", "mask": "causal"}) for gqa in ("on", "off")]
    out += [Config("moe", "ours", one, "fp32", dict(moe.SIZES, e=4, k=2),
                   {"emesh": "dense", "cap": "none", "score": "softmax", "norm": "off", "route": "rand", "aux": aux})
            for aux in ("on", "off")]
    out += [Config("pp", "ours", one, "fp32", dict(pipeline.SIZES, b=2, m=2, l=2, vs=1),
                   {"sched": "gpipe", "tied": tied}) for tied in ("on", "off")]
    out.append(Config("fsdp", "ours", one, "fp32", dict(fsdp.SIZES, m=1)))
    out.append(Config("ckpt", "dcp", one, "fp32", checkpoint.SIZES, {"save": "fsdp1", "load": "fsdp1"}))
    return out


def expand(pattern: str) -> list[str]:
    """``step{1,2}/{grad,param}/w`` -> the four names it stands for."""
    parts = re.split(r"\{([^}]*)\}", pattern)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def shape_of(text: str, symbols: dict[str, int]) -> tuple[int, ...]:
    """``[2f, kv*d]`` -> its dims under the config's sizes (``2f`` reads as ``2*f``)."""
    inner = text.strip()[1:-1].strip()
    if not inner:
        return ()
    dims = []
    for dim in inner.split(","):
        expr = re.sub(r"(\d)([a-z])", r"\1*\2", dim.strip())
        dims.append(int(eval(expr, {"__builtins__": {}}, symbols)))  # noqa: S307  the page's own arithmetic
    return tuple(dims)


def table_rows() -> list[dict]:
    """The page's rows: component, when ({switch: values} or {}), [(name pattern, shape text)]."""
    text = PAGE.read_text()
    assert SECTION in text, f"{PAGE.name} lost its section {SECTION!r}"
    body = text.split(SECTION, 1)[1]
    rows = []
    for line in body.splitlines():
        if line.startswith("### ") or line.startswith("## "):
            break
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        component, when, results, shapes = cells[0].strip("`"), cells[1], cells[2], cells[3]
        names = re.findall(r"`([^`]+)`", results)
        dims = re.findall(r"`(\[[^`]*\])`", shapes)
        assert len(dims) in (1, len(names)), f"{PAGE.name} row {line!r}: {len(names)} results but {len(dims)} shapes"
        condition = {}
        if when:
            key, _, values = when.partition(":")
            condition = {key.strip(): {v.strip() for v in values.split(",")}}
        rows.append({"component": component, "when": condition,
                     "results": [(n, dims[i] if len(dims) > 1 else dims[0]) for i, n in enumerate(names)]})
    return rows


def documented(cfg: Config, rows: list[dict]) -> dict[str, tuple[int, ...]]:
    """What the page says ``cfg``'s reference returns: {name: shape}."""
    symbols = dict(cfg.sizes)
    if cfg.component == "ringattn":
        symbols["kv"] = ring_attention.kv_heads(cfg)
    switches = dict(cfg.switches)
    out: dict[str, tuple[int, ...]] = {}
    for row in rows:
        if row["component"] != cfg.component:
            continue
        if any(switches.get(key) not in values for key, values in row["when"].items()):
            continue
        for pattern, dims in row["results"]:
            for name in expand(pattern):
                assert name not in out, f"{PAGE.name} lists {cfg.component} result {name!r} twice for {cfg.id}"
                out[name] = shape_of(dims, symbols)
    return out


def test_every_built_in_component_has_rows():
    assert {row["component"] for row in table_rows()} == set(BUILT_IN)


@pytest.mark.parametrize("cfg", _configs(), ids=str)
def test_readme_names_and_shapes_match_the_reference(cfg):
    torch.set_num_threads(1)
    want = documented(cfg, table_rows())
    got = {name: tuple(t.shape) for name, t in reference_of(get(cfg.component).reference, cfg.problem).items()}
    assert sorted(got) == sorted(want), (
        f"{cfg.id}: {PAGE.name} documents {sorted(set(want) - set(got))} that the reference does not return, "
        f"and omits {sorted(set(got) - set(want))}")
    wrong = {name: (want[name], got[name]) for name in got if want[name] != got[name]}
    assert not wrong, f"{cfg.id}: {PAGE.name}'s shapes (documented, actual) differ: {wrong}"
