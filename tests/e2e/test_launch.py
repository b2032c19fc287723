"""The launch path end to end, through the real CLI: torchrun with 2 nodes x 1 process on 127.0.0.1 trains
exactly as 1 node x 2 processes, and its TensorBoard event files hold every tag of the trainer.
(The resumed step axis is checked in test_train_e2e.py.)
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import env
from safetensors.torch import load_file

from coati_kto.parallel.distributed import free_port
from coati_kto.testing.cli import run_cli
from coati_kto.testing.tensorboard import read_scalars

GOOD = ["Paris is the capital.", "The answer is 5.", "Here is the result, thank you!"]
BAD = ["I cannot help with that.", "Sorry, that is not possible."]


def _write_data(path: Path, n: int = 48) -> Path:
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(n):
            label = i % 4 != 0  # 3:1 desirable:undesirable
            completion = rng.choice(GOOD if label else BAD)
            f.write(
                json.dumps(
                    {"prompt": f"Question {i}: please answer.", "completion": completion, "label": label}
                )
            )
            f.write("\n")
    return path


@pytest.fixture(scope="module")
def run_config(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("launch")
    data = _write_data(root / "train.jsonl")
    config = root / "config.yaml"
    config.write_text(
        f"""
model:
  path: {tiny_model_dir}
data:
  train_files: [{data}]
  eval_fraction: 0.2
  prepared_dir: {root / "prepared"}
  max_length: 64
  max_prompt_length: 32
kto:
  beta: 0.1
train:
  seed: 7
  micro_batch_size: 2
  accumulation_steps: 2
  max_steps: 3
  lr: 1.0e-3
  eval_interval: 2
plugin:
  name: hybrid_parallel
  zero_stage: 2
  precision: bf16
output:
  dir: {root / "out"}
  save_interval: 1
logging:
  tensorboard: true
"""
    )
    # Prepare once so the concurrent launches below only read the cache (the CLI's code path: on a worker rank).
    prepared = run_cli(["prepare", str(config)])
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    return config


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args, "-m", "coati_kto", "train"]


def _final_weights(out_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(out_dir / "final" / "model.safetensors")


def _check(procs: list[subprocess.Popen], timeout: float = 600) -> None:
    for proc in procs:
        out, _ = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, out[-4000:]


def test_two_nodes_match_one_node_with_two_processes(run_config: Path, tmp_path: Path) -> None:
    # 1 node x 2 processes is what run_cli's 2 ranks see (RANK = LOCAL_RANK, LOCAL_WORLD_SIZE 2; same code, same
    # machine, 1 thread): on worker ranks. The 2 nodes are the launcher under test: real torchrun agents.
    one_node = tmp_path / "one_node"
    done = run_cli(["train", str(run_config), f"output.dir={one_node}"], 2)
    assert done.returncodes == [0, 0], (done.stdout + done.stderr)[-4000:]

    two_nodes = tmp_path / "two_nodes"
    port = free_port()
    procs = []
    for node_rank in range(2):
        cmd = _torchrun(
            "--nnodes=2",
            f"--node_rank={node_rank}",
            "--nproc_per_node=1",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
        ) + [str(run_config), f"output.dir={two_nodes}"]
        procs.append(
            subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    _check(procs)

    a, b = _final_weights(one_node), _final_weights(two_nodes)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert (two_nodes / "checkpoints" / "latest").read_text().strip() == "step-3"
    # The run trained: the final weights moved away from the initial ones.
    initial = load_file(Path(load_config_path(run_config)) / "model.safetensors")
    assert any(not torch.equal(initial[n].to(a[n].dtype), a[n]) for n in a)

    scalars = read_scalars(two_nodes / "tensorboard")
    assert set(scalars) >= TAGS, sorted(TAGS - set(scalars))
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3]
    assert [s for s, _ in scalars["eval/loss"]] == [0, 2, 3]  # step-0 baseline, every eval_interval, the end
    # 2 data-parallel ranks x micro-batch 2 x accumulation 2 = 8 examples per step.
    for (_, chosen), (_, rejected) in zip(
        scalars["train/count/chosen"], scalars["train/count/rejected"], strict=True
    ):
        assert chosen + rejected == 8 and chosen >= 1 and rejected >= 1


def test_torchrun_script_reads_a_config_relative_to_where_it_is_run(run_config: Path, tmp_path: Path) -> None:
    """launch/torchrun.sh cd's to the repo root: `bash /repo/launch/torchrun.sh my.yaml` from the config's
    directory said "my.yaml: config file not found" although the file was right there."""
    script = Path(__file__).resolve().parents[2] / "launch" / "torchrun.sh"
    out = tmp_path / "relative"
    proc = subprocess.run(
        ["bash", str(script), run_config.name, f"output.dir={out}", "train.max_steps=2"],
        cwd=run_config.parent,
        env={**env(), "NPROC_PER_NODE": "1", "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    scalars = read_scalars(out / "tensorboard")
    assert [s for s, _ in scalars["train/loss"]] == [1, 2]
    assert sum(v for _, v in scalars["train/count/chosen"] + scalars["train/count/rejected"]) == 2 * 2 * 2


def load_config_path(config: Path) -> str:
    import yaml

    return yaml.safe_load(config.read_text())["model"]["path"]


TAGS = {
    f"{split}/{name}"
    for split in ("train", "eval")
    for name in (
        "loss",
        "kl",
        "kl_raw",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "logits/chosen",
        "logits/rejected",
        "logps/chosen",
        "logps/rejected",
        "count/chosen",
        "count/rejected",
    )
} | {f"train/{name}" for name in ("grad_norm", "lr", "epoch", "examples_per_second", "tokens_per_second")}


def test_launcher_env_leaves_out_what_colossalai_run_cannot_quote(monkeypatch: pytest.MonkeyPatch) -> None:
    from coati_kto.parallel.launch_env import launcher_env

    # Under `make quickstart ARGS=...`, make exports this; colossalai run's `export K="V"` line then fails
    # with "bad substitution" (the CI failure this test pins).
    monkeypatch.setenv("MAKEOVERRIDES", "${-*-command-variables-*-}")
    monkeypatch.setenv("QUOTED", 'say "hi"')
    monkeypatch.setenv("PLAIN", "a b/c:d")
    env = launcher_env("/opt/venv/bin", threads=1)
    assert "MAKEOVERRIDES" not in env and "QUOTED" not in env
    assert env["PLAIN"] == "a b/c:d"
    assert env["PATH"].startswith("/opt/venv/bin" + os.pathsep)
    assert env["OMP_NUM_THREADS"] == "1"
    assert {"MAKEOVERRIDES", "QUOTED"} <= set(env["COATI_KTO_DROPPED_ENV"].split(","))
    # What survives round-trips through the shell exactly as colossalai run builds the command.
    line = " ".join(f'{k}="{v}"' for k, v in env.items() if k in {"PLAIN", "PATH"})
    out = subprocess.run(
        ["bash", "-c", f'export {line} && printf %s "$PLAIN"'], capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout == "a b/c:d"
