"""A checkpoint's trainer state (``trainer_state/rank-N.pt``) loads without unpickling code: checkpoints come from
elsewhere (``hf download`` then ``train.resume``, ``coati-kto export --checkpoint`` of another user's run). It was
read with ``torch.load(weights_only=False)``, and a crafted file ran its payload at resume and at export."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from coati_kto.errors import UserError
from coati_kto.runtime.run_dir import TRAINER_STATE_DIR, saved_trainer_state
from coati_kto.trainer.checkpoint_state import rng_state, set_rng_state


class _Payload:
    """What a crafted checkpoint pickles: loading it creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.mkdir, (str(self.marker),))


def _saved(checkpoint: Path, state: dict) -> Path:
    (checkpoint / TRAINER_STATE_DIR).mkdir(parents=True)
    torch.save(state, checkpoint / TRAINER_STATE_DIR / "rank-0.pt")
    return checkpoint


def test_a_crafted_trainer_state_is_refused_in_one_line_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "payload-ran"
    checkpoint = _saved(tmp_path / "step-3", {"trainer_state": {"global_step": 3}, "x": _Payload(marker)})
    with pytest.raises(UserError) as err:
        saved_trainer_state(checkpoint)
    assert str(err.value) == (
        f"{checkpoint / TRAINER_STATE_DIR / 'rank-0.pt'}: holds posix.mkdir besides tensors and plain data, which no "
        "checkpoint coati-kto writes holds; refused (loading it could run code): resume or export only checkpoints "
        "you trust"
    )
    assert not marker.exists()


def test_the_rng_states_round_trip_through_a_safe_load(tmp_path: Path) -> None:
    """The state a checkpoint saves now (numpy's key as plain ints) and the one saved before 2026-12-02 (numpy's
    ndarray, allowed by name) both load and put every generator back where it was."""
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.rand(7)
    now = rng_state()
    draws = (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist())
    name, key, *rest = now["numpy"]
    assert isinstance(key, list)  # plain ints
    before = {
        **now,
        "numpy": (name, np.asarray(key, dtype=np.uint32), *rest),
    }  # as np.random.get_state() gives
    for folder, state in (("now", now), ("before", before)):
        loaded = saved_trainer_state(_saved(tmp_path / folder, {"trainer_state": {}, "rng": state}))
        random.seed(9), np.random.seed(9), torch.manual_seed(9)
        set_rng_state(loaded["rng"])
        assert (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist()) == draws, folder


def test_a_crafted_scheduler_or_master_file_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    """The booster's files and the fp32 master shards load with weights_only (torch's default): a crafted one was
    refused with an UnpicklingError traceback; it is now the same one line, and nothing runs."""
    from types import SimpleNamespace

    from coati_kto.trainer.checkpoint_state import load_booster_state, load_masters

    marker = tmp_path / "payload-ran"
    checkpoint = tmp_path / "step-3"
    checkpoint.mkdir()
    torch.save({"last_epoch": 3, "x": _Payload(marker)}, checkpoint / "lr_scheduler.pt")
    torch.save({"w": torch.zeros(2), "x": _Payload(marker)}, checkpoint / "rank-0.pt")
    booster = SimpleNamespace(
        load_model=lambda model, where: None,
        load_optimizer=lambda optimizer, where: None,
        load_lr_scheduler=lambda scheduler, where: torch.load(where),  # as ColossalAI's does
    )
    line = "holds posix.mkdir besides tensors and plain data, which no checkpoint coati-kto writes holds; refused"
    with pytest.raises(UserError, match=f"^{checkpoint}: {line}"):
        load_booster_state(booster, checkpoint, torch.nn.Linear(2, 2), None, None)
    with pytest.raises(UserError, match=f"^{checkpoint / 'rank-0.pt'}: {line}"):
        load_masters(checkpoint / "rank-0.pt")
    assert not marker.exists()


def test_numpy_arrays_and_scalars_of_any_dtype_load_under_both_numpy_spellings(tmp_path: Path) -> None:
    """From the review of the weights_only load: an image run's checkpoint keeps the image TensorBoard logged (a
    uint8 CHW array, ``tensorboard_at_step``) and was refused as "an object no checkpoint coati-kto writes holds";
    a trainer state written under numpy 1 names ``numpy.core.multiarray`` and was refused under numpy 2."""
    import zipfile

    state = {
        "trainer_state": {
            "tensorboard_at_step": {"image": np.zeros((3, 4, 5), np.uint8)},
            "x": np.float64(0.5),
        },
        "rng": {"numpy": np.random.get_state()},
    }
    checkpoint = _saved(tmp_path / "step-2", state)
    loaded = saved_trainer_state(checkpoint)
    assert loaded["trainer_state"]["tensorboard_at_step"]["image"].dtype == np.uint8
    assert loaded["trainer_state"]["x"] == 0.5
    # the same file as numpy 1 pickles it: the module names spelled numpy.core
    rank0 = checkpoint / TRAINER_STATE_DIR / "rank-0.pt"
    old = tmp_path / "numpy1"
    (old / TRAINER_STATE_DIR).mkdir(parents=True)
    with zipfile.ZipFile(rank0) as src, zipfile.ZipFile(old / TRAINER_STATE_DIR / "rank-0.pt", "w") as out:
        for item in src.infolist():
            data = src.read(item.filename)
            if item.filename.endswith("data.pkl"):
                assert b"numpy._core.multiarray" in data
                data = data.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
            out.writestr(item, data)
    assert saved_trainer_state(old)["trainer_state"]["x"] == 0.5
