"""Global rank 0 works, the other ranks wait for it: a failure on rank 0 reaches them at once, through the same
broadcast of its outcome that a success goes through (``on_rank0``), so every rank ends with rank 0's one line.

Before: the reference cache's write and output.overwrite's deletion were followed by a bare wait that only
rank 0's success ended (library use, and a node whose launcher outlived rank 0's: train.file_wait_timeout, 2 h);
a model card that failed on rank 0 raised an error marked "the same on every rank" there alone, so nothing told
the others (in-process store: a C++ dump and "another rank or node is gone", exit 1); and rank 0's unexpected error
in a decision (``on_rank0``: prepare the data) was a RuntimeError traceback on every other rank."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
import yaml
from helpers import preference_records

from coati_kto.data.files import write_jsonl
from coati_kto.testing.cli import run_cli
from coati_kto.testing.distributed import run_distributed

WAIT_S = 20.0  # train.file_wait_timeout here: what a rank left waiting sat through before
FULL = (28, "No space left on device")


class _FullDisk:
    """numpy, whose ``save`` finds the disk full (the reference cache's module reads it as ``np``)."""

    def __getattr__(self, name: str):
        return getattr(np, name)

    @staticmethod
    def save(path, *args, **kwargs) -> None:
        raise OSError(*FULL, str(path))


def _outcome(work) -> dict:
    """What this rank's ``work()`` raised (class, line) and after how many seconds, the waits bounded by WAIT_S."""
    from coati_kto.parallel import store_waits

    store_waits.set_timeout(WAIT_S)
    started = time.monotonic()
    try:
        work()
        return {"error": None}
    except Exception as err:  # noqa: BLE001 - the test compares what each rank raised
        return {"error": (type(err).__name__, str(err)), "seconds": time.monotonic() - started}
    finally:
        store_waits.set_timeout(store_waits.DEFAULT_TIMEOUT_S)


def _cache_write_fails_on_rank0(root: str) -> dict:
    """Every rank: the reference cache computed (scores stubbed) for a fake reference; rank 0's write fails."""
    import coati_kto.reference.cache as cache
    from coati_kto.config.schema import Config
    from coati_kto.reference.settings import ReferenceSettings

    model = Path(root) / "model"
    config = Config.model_validate(
        {
            "model": {"path": str(model)},
            "data": {"train_files": "data.jsonl", "prepared_dir": str(Path(root) / "prepared")},
            "output": {"dir": "out"},
        }
    )
    settings = ReferenceSettings(config.model, config.data, config.kto, torch.float32)
    data = SimpleNamespace(train=[0, 1, 2], eval=None, stats={"fingerprint": "data-digest"})
    cache.score_splits = lambda *args: {"train": np.zeros((3, 2), np.float32)}  # put back by the pool's reset
    if dist.get_rank() == 0:
        cache.np = _FullDisk()
    return _outcome(lambda: cache.ensure_reference_cache(settings, data, 0))


def test_a_failed_reference_cache_write_ends_every_rank_with_its_line(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\x01" * 64)
    (model / "config.json").write_text("{}")
    rank0, rank1 = run_distributed(_cache_write_fails_on_rank0, 2, str(tmp_path))
    kind, line = rank0["error"]
    assert kind == "UserError" and line.startswith("the reference cache could not be written to ")
    cache_dir = tmp_path / "prepared" / "reference_cache"
    assert "(No space left on device: " in line and line.endswith(
        f"the other caches under {cache_dir} are as they were"
    )
    assert rank1["error"] == rank0["error"]  # was FileWaitTimeoutError after WAIT_S
    assert rank1["seconds"] < WAIT_S / 4
    assert sorted(p.name for p in cache_dir.iterdir()) == ["weights_sha256.json"]  # nothing of it kept


def _overwrite_fails_on_rank0(out: str) -> dict:
    """Every rank: output.overwrite's deletion of the earlier run's final/, refused on rank 0."""
    import coati_kto.runtime.run_dir as run_dir

    def refused(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(Path(path) / "model.safetensors"))

    if dist.get_rank() == 0:
        run_dir.shutil = SimpleNamespace(rmtree=refused)  # put back by the pool's reset
    return _outcome(lambda: run_dir.clear_previous_run(Path(out)))


def test_output_overwrite_that_cannot_delete_ends_every_rank_with_its_line(tmp_path: Path) -> None:
    (tmp_path / "final").mkdir()
    rank0, rank1 = run_distributed(_overwrite_fails_on_rank0, 2, str(tmp_path))
    final = tmp_path / "final"
    assert rank0["error"] == (
        "UserError",
        f"output.overwrite: {final} could not be deleted (Permission denied: {final / 'model.safetensors'})",
    )
    assert rank1["error"] == rank0["error"] and rank1["seconds"] < WAIT_S / 4  # was waiting WAIT_S


def _config(model_dir: Path, root: Path, **sections: dict) -> Path:
    """``root/config.yaml``: the tiny model on 8 records, ddp fp32, one step, the cache's scoring in one batch."""
    config = {
        "model": {"path": str(model_dir)},
        "data": {
            "train_files": [str(write_jsonl(preference_records(8, 0), root / "train.jsonl"))],
            "prepared_dir": str(root / "prepared"),
            "max_length": 24,
        },
        "kto": {"reference": "cached", "precompute_batch_size": 8},
        "train": {"micro_batch_size": 2, "max_steps": 1, "eval_at_start": False, "eval_at_epoch_end": False},
        "plugin": {"name": "ddp", "precision": "fp32"},
        "output": {"dir": str(root / "out")},
    }
    for name, values in sections.items():
        config[name].update(values)
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _precompute_with_a_full_disk(argv: list[str]) -> int:
    """``coati-kto precompute`` whose global rank 0 finds the disk full as it writes the cache."""
    import coati_kto.reference.cache as cache
    from coati_kto.cli import main

    if os.environ["RANK"] == "0":
        cache.np = _FullDisk()  # put back by the pool's reset
    return main(argv)


def test_precompute_whose_cache_write_fails_says_it_once(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Rank 0's one line, exit 2 on every rank (was: its traceback, exit 1, and a line per other rank)."""
    path = _config(tiny_model_dir, tmp_path)
    proc = run_cli(["precompute", str(path)], 2, command=_precompute_with_a_full_disk, timeout_s=120)
    rank0, rank1 = proc.ranks
    assert (rank0.returncode, rank1.returncode) == (2, 2), rank0.stderr + rank1.stderr
    (line,) = rank0.stderr.strip().splitlines()
    cache = tmp_path / "prepared" / "reference_cache"
    assert line.startswith(f"error: the reference cache could not be written to {cache}/")
    assert "(No space left on device: " in line and line.endswith(
        f"the other caches under {cache} are as they were"
    )
    assert rank1.stderr == ""


def _precompute_whose_build_fails(argv: list[str]) -> int:
    """``coati-kto precompute`` whose global rank 0 fails unexpectedly while it prepares the data."""
    import coati_kto.data.prepared as prepared
    from coati_kto.cli import main

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "prepared/dataset_info.json")

    if os.environ["RANK"] == "0":
        prepared.ensure = refused  # put back by the pool's reset
    return main(argv)


def test_rank0s_unexpected_error_in_a_decision_is_one_line_on_the_others(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Rank 0 prints its traceback; the others one line each, exit 1 (was: a RuntimeError traceback each)."""
    path = _config(tiny_model_dir, tmp_path)
    proc = run_cli(["precompute", str(path)], 2, command=_precompute_whose_build_fails, timeout_s=120)
    rank0, rank1 = proc.ranks
    assert proc.returncodes == [1, 1]
    assert rank0.stderr.strip().splitlines()[-1] == (
        "PermissionError: [Errno 13] Permission denied: 'prepared/dataset_info.json'"
    )
    assert rank1.stderr.strip().splitlines() == [
        "[rank 1] error: rank 0: PermissionError: [Errno 13] Permission denied: 'prepared/dataset_info.json' "
        "(its traceback is in its log) (this rank was waiting for global rank 0 to prepare the data); run "
        "coati-kto precompute again (it reuses the prepared data and any complete reference cache)"
    ]  # was "resume with train.resume=auto": precompute has nothing to resume


def _train_whose_card_fails(argv: list[str]) -> int:
    """``coati-kto train`` whose global rank 0 finds the disk full as it writes final/'s model card."""
    import coati_kto.recipe.save as save
    from coati_kto.cli import main

    def full(final, card):
        raise OSError(*FULL, str(final / "README.md"))

    if os.environ["RANK"] == "0":
        save.write_card = full  # put back by the pool's reset
    return main(argv)


def test_a_model_card_that_fails_on_rank0_ends_every_rank_with_its_line(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Exit 2 on every rank, rank 0's line only (was: rank 1 left waiting in train's wait for final/)."""
    path = _config(tiny_model_dir, tmp_path, kto={"reference": "online"}, train={"file_wait_timeout": WAIT_S})
    started = time.monotonic()
    proc = run_cli(["train", str(path)], 2, command=_train_whose_card_fails, timeout_s=120)
    rank0, rank1 = proc.ranks
    assert proc.returncodes == [2, 2], rank1.stderr[-2000:]
    final = tmp_path / "out" / "final"
    assert rank0.stderr.strip().splitlines()[-1] == (
        f"error: the model card could not be written to {final} (No space left on device: {final}/README.md): "
        "removed final/; train.resume=auto writes it again"
    )
    assert rank1.stderr == "" and not final.exists()
    assert time.monotonic() - started < 60
