"""What a checkpoint holds per rank beside the booster's files: this rank's RNG states and fp32 master shard, and
on a resume on another layout the saved data-parallel ranks' trainer states (coati_kto.trainer.checkpoint)."""

from __future__ import annotations

import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from coati_kto.errors import UserError
from coati_kto.models.lora import base_module
from coati_kto.parallel.masters import working_to_master
from coati_kto.runtime.run_dir import refused_pickle, saved_trainer_state
from coati_kto.trainer.export import save_tied_weights_once
from coati_kto.trainer.tied_load import load_tied_aliases


def load_booster_state(booster: Any, path: Path, model: Any, optimizer: Any, lr_scheduler: Any) -> None:
    """Every rank: checkpoint ``path``'s model, optimizer and scheduler files through the booster (torch.load with
    weights_only, torch's default). A file holding other objects (a crafted checkpoint) is refused in one line,
    not an UnpicklingError traceback."""
    try:
        save_tied_weights_once(base_module(model))
        booster.load_model(model, str(path / "model"))
        load_tied_aliases(model, path / "model")  # a pp 1 checkpoint's tie, on the stage holding the LM head
        booster.load_optimizer(optimizer, str(path / "optimizer"))
        booster.load_lr_scheduler(lr_scheduler, str(path / "lr_scheduler.pt"))
    except pickle.UnpicklingError as err:
        raise refused_pickle(path, err) from None


def load_masters(master_file: Path) -> dict[str, torch.Tensor]:
    """This rank's saved fp32 master shard (tensors only; anything else refused in one line)."""
    try:
        return torch.load(master_file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise refused_pickle(master_file, err) from None


def old_dp_states(path: Path, meta: dict) -> list[dict]:
    """The saved run's trainer states, one per data-parallel rank in dp-rank order (tensor-parallel peers of a
    dp rank share its data position). Raises UserError when they do not describe one step of one run."""
    world, dp_size = int(meta["world_size"]), int(meta["dp_size"])
    by_dp: dict[int, dict] = {}
    for rank in range(world):
        state = saved_trainer_state(path, rank)["trainer_state"]
        # States saved before dp_rank was recorded come from dp-only layouts, where dp rank = global rank.
        dp_rank = int(state.get("dp_rank", rank))
        by_dp.setdefault(dp_rank, state)
    steps = {(int(s["global_step"]), int(s["epoch"])) for s in by_dp.values()}
    if sorted(by_dp) != list(range(dp_size)) or len(steps) != 1:
        raise UserError(
            f"train.resume: {path} holds trainer states of dp ranks {sorted(by_dp)} at (step, epoch) "
            f"{sorted(steps)}; expected dp ranks 0..{dp_size - 1} at one step: the checkpoint is inconsistent"
        )
    return [by_dp[r] for r in range(dp_size)]


def master_shards(model: Any, optimizer: Any) -> dict[str, torch.Tensor]:
    """This rank's fp32 masters whose working parameter has a lower precision, by parameter name.

    fp32 runs have none (the masters equal the working weights, which the model checkpoint holds exactly).
    """
    mapping = working_to_master(optimizer)
    shards = {}
    for name, param in model.unwrap().named_parameters():
        master = mapping.get(id(param))
        if master is not None and master.dtype != param.dtype:
            shards[name] = master.detach().cpu().clone()
    return shards


def masters_fit(model: Any, optimizer: Any, shards: dict[str, torch.Tensor], whole: bool = False) -> bool:
    """Whether :func:`restore_masters` can copy ``shards`` into this layout's masters: not after a change between
    ZeRO's flat shards and the AMP optimizer's whole masters over several data-parallel ranks (plugin.zero_stage
    0 <-> 1 or 2), which no file of this rank's holds whole."""
    mapping = working_to_master(optimizer)
    params = dict(model.unwrap().named_parameters())
    for name, saved in shards.items():
        master = mapping.get(id(params[name])) if name in params else None
        if master is None:
            return False
        numel = params[name].numel()
        if master.shape != saved.shape and not (whole and min(master.numel(), saved.numel()) >= numel):
            return False
    return True


def restore_masters(model: Any, optimizer: Any, shards: dict[str, torch.Tensor], whole: bool = False) -> None:
    """Copy this rank's saved masters into the optimizer's.

    ``whole``: one data-parallel rank, where every master holds its whole parameter whatever the optimizer, as
    ZeRO's flat copy or the AMP optimizer's shaped one: a checkpoint of either restores into the other exactly
    (a backend's running stage at dp 1 may differ from the configured one: ``ParallelBackend.running_zero_stage``).
    """
    mapping = working_to_master(optimizer)
    params = dict(model.unwrap().named_parameters())
    with torch.no_grad():
        for name, saved in shards.items():
            master = mapping[id(params[name])]
            numel = params[name].numel()
            if whole and master.shape != saved.shape and min(master.numel(), saved.numel()) >= numel:
                master.view(-1)[:numel].copy_(saved.reshape(-1)[:numel])
                continue
            if master.shape != saved.shape:
                raise UserError(
                    f"checkpoint master shard of {name} has shape {tuple(saved.shape)}, "
                    f"this layout expects {tuple(master.shape)}"
                )
            master.copy_(saved)


def rng_state() -> dict[str, Any]:
    """Python's, numpy's, torch's and (with CUDA) the device's RNG states of this process."""
    name, key, pos, has_gauss, gauss = np.random.get_state()
    # numpy's as plain ints: the trainer state then loads with torch.load(weights_only=True) (run_dir)
    numpy_state = (name, key.tolist(), int(pos), int(has_gauss), float(gauss))
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Put back what :func:`rng_state` recorded (the device's where there is one)."""
    random.setstate(state["python"])
    name, key, *rest = state["numpy"]  # key: an ndarray in checkpoints before 2026-12-02, plain ints since
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
