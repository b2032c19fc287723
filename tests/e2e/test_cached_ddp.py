"""ddp with the cached reference, 2 processes, through the CLI: prepare, precompute, train with checkpoints,
resume from step 3, the resumed run's final weights equal the uninterrupted run's bit for bit.

The setup that hung or aborted in gloo when ranks folded their KL passes differently (DDP's forward enters a
collective); the mismatch itself is pinned by ``tests/distributed/test_policy_packing.py``
(``test_ddp_never_folds_so_ranks_meet_the_same_collectives``), which fails without the fix. This is the lifecycle.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from helpers import env
from safetensors.torch import load_file

from coati_kto.testing.cli import run_cli

GOOD = ["Paris is the capital.", "The answer is 5.", "Here is the result, thank you!"]
BAD = ["I cannot help with that.", "Sorry, that is not possible."]


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "coati_kto", *args]
    return subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=600)


def test_cached_reference_under_ddp_runs_and_resumes_exactly(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = tmp_path / "train.jsonl"
    with data.open("w") as f:
        for i in range(48):  # prompts of 5 lengths
            label = i % 4 != 0
            prompt = f"Question {i}: please answer" + " more" * (i % 5) + "."
            completion = (GOOD if label else BAD)[i % (3 if label else 2)]
            f.write(json.dumps({"prompt": prompt, "completion": completion, "label": label}) + "\n")
    config = tmp_path / "config.yaml"
    config.write_text(
        f"model: {{path: {tiny_model_dir}}}\n"
        f"data: {{train_files: [{data}], prepared_dir: {tmp_path / 'prepared'}, max_length: 64}}\n"
        "train: {seed: 4, micro_batch_size: 2, max_steps: 6, lr: 1.0e-3, dist_timeout: 60}\n"
        "plugin: {name: ddp, precision: fp32}\n"
        "kto: {reference: cached}\n"
        f"output: {{dir: {tmp_path / 'out'}, save_interval: 3, keep_last: 3}}\n"
        "logging: {tensorboard: false}\n"
    )
    # prepare, precompute (1 process) and the uninterrupted training (2 ranks) are the CLI's code path: on worker
    # ranks (coati_kto.testing.cli); same code, same machine, 1 thread: the same bits as a launch. The resume is
    # the real launch: torchrun's 2 processes, reading everything from disk.
    assert run_cli(["prepare", str(config)]).returncode == 0
    assert run_cli(["precompute", str(config)]).returncode == 0
    # With the online reference the cache would go unread: said before scoring (it built one in silence).
    online = run_cli(["precompute", str(config), "kto.reference=online"])
    assert online.returncode == 0, online.stderr[-2000:]
    assert online.stdout.splitlines()[0] == (
        "note: kto.reference is online: train scores the reference as it goes and does not read this cache; "
        "train with kto.reference=cached to use it"
    )
    assert "reference log-probs: reusing" in online.stdout  # the cache the cached reference reads
    full = run_cli(["train", str(config)], 2)
    assert full.returncodes == [0, 0], full.stdout[-2000:] + full.stderr[-2000:]
    whole = load_file(tmp_path / "out" / "final" / "model.safetensors")
    resumed_dir = tmp_path / "resumed"
    resumed = _cli(
        "train", "--nproc-per-node", "2", str(config), f"output.dir={resumed_dir}",
        f"train.resume={tmp_path / 'out' / 'checkpoints' / 'step-3'}",
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    # The launcher says it first, before its workers start; rank 0 does not say it again.
    said = (
        f"resuming from {tmp_path / 'out' / 'checkpoints' / 'step-3'} (train.resume); to start over instead"
    )
    assert resumed.stdout.splitlines()[0].startswith(said), resumed.stdout[:500]
    assert resumed.stdout.count("resuming from") == 1
    after = load_file(resumed_dir / "final" / "model.safetensors")
    assert whole.keys() == after.keys() and all(torch.equal(whole[k], after[k]) for k in whole)
