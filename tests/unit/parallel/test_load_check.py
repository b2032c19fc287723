"""What a rank holds in host memory while it loads (coati_kto.parallel.memory_plan.load_host_bytes), and the one
line that refuses a node short of it (coati_kto.parallel.load_check); the vote over ranks:
tests/distributed/test_load_check_train.py."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from coati_kto.parallel.activations import Workload
from coati_kto.parallel.load_check import GIB, available_host_bytes, load_refusal, nodes_refusal
from coati_kto.parallel.memory_plan import load_host_bytes
from coati_kto.parallel.model_shape import cast_rounds, model_shape

SHAPES = Path(__file__).resolve().parents[3] / "benchmarks" / "model_shapes"


def test_a_rank_holds_the_model_in_fp32_and_the_cast_keeps_fp32_values() -> None:
    shape = model_shape(str(SHAPES / "llama-3.1-70b"))  # 70,553,706,496 parameters, stored in bf16
    online = Workload(micro_batch=1, length=128)
    assert load_host_bytes(shape, online, cast_rounds=False) == 4 * 70_553_706_496
    # stored in fp32: the masters start from the fp32 values, kept beside the bf16 copy
    assert load_host_bytes(shape, online, cast_rounds=True) == 6 * 70_553_706_496
    lora = Workload(micro_batch=1, length=128, lora_rank=8, lora_targets=["q_proj"])
    assert load_host_bytes(shape, lora, cast_rounds=True) == 4 * 70_553_706_496  # frozen: no masters


def test_the_cast_rounds_what_config_json_stores_in_another_dtype(tmp_path: Path) -> None:
    """Where the cast to the working dtype rounds nothing (a checkpoint stored in bf16 trained in bf16), nothing
    is kept through it: no 4 bytes per parameter of host memory, no pass over the weights."""
    assert not cast_rounds(str(SHAPES / "llama-3.1-70b"), "bf16")  # torch_dtype bfloat16
    assert not cast_rounds(str(SHAPES / "llama-3.1-70b"), "fp32")  # no cast
    for config, bf16, fp16 in (
        ({"dtype": "float32"}, True, True),
        ({"dtype": "bfloat16"}, False, True),
        ({"torch_dtype": "float16"}, True, False),  # fp16 values are not all bf16 values
        ({}, True, True),  # nothing said: transformers' own default, fp32
        ({"text_config": {"dtype": "bfloat16"}}, False, True),
    ):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
        assert (cast_rounds(str(folder), "bf16"), cast_rounds(str(folder), "fp16")) == (bf16, fp16), config


def test_the_refusal_names_the_node_and_both_amounts() -> None:
    assert load_refusal(100 * GIB, 8, 900 * GIB) is None
    assert load_refusal(100 * GIB, 8, None) is None  # nothing known: no refusal
    assert "(0.50 MiB per rank), 1.00 MiB for the 2 rank(s)" in (load_refusal(1 << 19, 2, 1) or "")
    assert load_refusal(100 * GIB, 8, 700 * GIB) == (
        "host memory: each rank reads the whole model into host memory in fp32 as it loads (100.0 GiB per "
        f"rank), 800.0 GiB for the 8 rank(s) on {socket.gethostname()}, which has 700.0 GiB available "
        "(MemAvailable): start fewer ranks per node or free host memory (`coati-kto plan CONFIG --gpus N "
        "--nodes M` shows the need; COATI_KTO_NO_HOST_MEMORY_CHECK=1 skips this check)"
    )


def test_memavailable_is_read_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n")
    assert available_host_bytes(meminfo) == 20_000_000 * 1024
    meminfo.write_text("MemTotal:       24000000 kB\n")
    assert available_host_bytes(meminfo) is None
    assert available_host_bytes(tmp_path / "none") is None
    assert (available_host_bytes() or 0) > 0  # this machine's


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_tiny_model_fits_here(precision: str, tiny_model_dir: Path) -> None:
    shape = model_shape(str(tiny_model_dir))
    need = load_host_bytes(
        shape, Workload(micro_batch=2, length=48), cast_rounds(str(tiny_model_dir), precision)
    )
    assert need == (6 if precision == "bf16" else 4) * shape.params  # the tiny model is saved in fp32
    assert load_refusal(need, 2, available_host_bytes()) is None


def test_ranks_are_grouped_into_nodes_by_host_name_and_every_short_node_is_named() -> None:
    """Every rank's (host, need, available, skip): a node's need is its ranks' sum (whatever the launcher: no
    LOCAL_WORLD_SIZE), its memory the least its ranks read; a rank that knows no need (config.json unread) adds
    nothing; one rank's COATI_KTO_NO_HOST_MEMORY_CHECK=1 turns the refusal off on all."""
    a = [("node-a", 100 * GIB, 500 * GIB, False)] * 4  # 400 GiB of 500: fits
    b = [("node-b", 100 * GIB, 350 * GIB, False), ("node-b", 100 * GIB, 300 * GIB, False)] * 2
    assert nodes_refusal(a) is None
    assert nodes_refusal(a + b) == (
        "host memory: each rank reads the whole model into host memory in fp32 as it loads (100.0 GiB per rank), "
        "400.0 GiB for the 4 rank(s) on node-b, which has 300.0 GiB available (MemAvailable): start fewer ranks "
        "per node or free host memory (`coati-kto plan CONFIG --gpus N --nodes M` shows the need; "
        "COATI_KTO_NO_HOST_MEMORY_CHECK=1 skips this check)"
    )
    c = [("node-c", 100 * GIB, 50 * GIB, False), ("node-c", None, None, False)]
    assert "; 100.0 GiB for the 2 rank(s) on node-c, which has 50.0 GiB available (" in (
        nodes_refusal(b + c) or ""
    )
    assert nodes_refusal([*b, ("node-a", 1, 1, True)]) is None
    assert nodes_refusal([("node-d", None, None, False)] * 8) is None  # nothing known
