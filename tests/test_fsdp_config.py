"""FSDP configs: each rule of harness/parallel/fsdp.py:validate rejects a bad config, with its message,
before any rank runs; the matrix itself is valid."""
import pytest

from cases.test_fsdp import CELLS
from harness.config import Config, ConfigError
from harness.resolve import check_config
from reference.fsdp import SIZES

GOOD = dict(SIZES, m=1)


@pytest.mark.parametrize("impl, mesh, dtype, sizes, message", [
    ("ours", {"dp": 2, "cp": 2}, "fp32", GOOD, r"fsdp cells take mesh dims dp \(FSDP\), rep,shard \(HSDP\) and tp, not \['cp'\]"),
    ("ours", {"rep": 2, "dp": 2}, "fp32", GOOD, r"FSDP is dp=N, HSDP is rep=R,shard=S"),
    ("ours", {"shard": 4}, "fp32", GOOD, r"FSDP is dp=N, HSDP is rep=R,shard=S"),
    ("ours", {"dp": 2, "shard": 2}, "fp32", GOOD, r"FSDP is dp=N, HSDP is rep=R,shard=S"),
    ("fsdp2", {"tp": 2}, "fp32", GOOD, r"has no data-parallel dim: add dp=N or rep=R,shard=S"),
    ("ours", {"shard": 2, "rep": 2}, "fp32", GOOD, r"must come in the order rep,shard"),
    ("fsdp2", {"tp": 2, "dp": 2}, "fp32", GOOD, r"must come in the order dp,tp"),
    ("ours", {"dp": 2}, "fp16", GOOD, r"fsdp dtype fp16: fp32, or bf16 for mixed precision"),
    ("ours", {"dp": 2, "tp": 2}, "fp32", GOOD, r"run dp×tp cells with impl fsdp2"),
    ("fsdp2", {"rep": 2, "shard": 2, "tp": 2}, "fp32", GOOD, r"fsdp with tp runs on dp=D,tp=T, not on an HSDP mesh"),
    ("fsdp2", {"dp": 1, "tp": 8}, "fp32", dict(GOOD, f=9), r"tp=8 leaves a rank an empty chunk of f=9"),
    ("ours", {"dp": 8}, "fp32", dict(GOOD, m=4), r"batch b=72 does not split into 8 data-parallel ranks x m=4 microbatches: choose b a multiple of 32"),
    ("ours", {"rep": 2, "shard": 4}, "fp32", dict(GOOD, b=12), r"batch b=12 does not split into 8 data-parallel ranks x m=1"),
    ("ours", {"dp": 2}, "fp32", {k: v for k, v in GOOD.items() if k != "m"}, r"size 'm' is missing"),
    ("ours", {"dp": 2}, "fp32", {k: v for k, v in GOOD.items() if k != "o"}, r"size 'o' is missing"),
])
def test_invalid_fsdp_configs_name_the_rule(impl, mesh, dtype, sizes, message):
    with pytest.raises(ConfigError, match=message):
        check_config(Config("fsdp", impl, mesh, dtype, sizes))


def test_the_fsdp_matrix_is_valid_and_large_enough():
    for cfg in CELLS:
        check_config(cfg, pool_size=8)
    assert len(CELLS) >= 50
    assert len({cfg.problem_key for cfg in CELLS}) == 4  # fp32/bf16 x m=1/3: four references for the lot
