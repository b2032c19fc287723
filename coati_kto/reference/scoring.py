"""The reference's log-probs of every example and its KL pair, without gradient, the rows split over the ranks and
gathered on rank 0; each batch scored as the policy's training passes will score it (its scoring plan)."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from coati_kto.data.collator import KTOCollator
from coati_kto.errors import UserError
from coati_kto.models.continuation import continued_logps
from coati_kto.models.hf import load_reference
from coati_kto.models.lm_head import LMHead
from coati_kto.models.packing import pair_logps
from coati_kto.parallel.model_shape import model_shape
from coati_kto.reference.settings import ReferenceSettings
from coati_kto.trainer.scoring_plan import ScoringRules
from coati_kto.trainer.shared_vision import shared_vision, view_logps


def score_rows(
    model: torch.nn.Module,
    rows: Any,
    order: np.ndarray,
    batch_size: int,
    pad_token_id: int,
    kl_continuation: bool = False,
    folds: bool = False,
    images: dict[str, Any] | None = None,
):
    """Reference (example, KL pair) log-probs of ``rows[order]``: float32 [len(order), 2]. No grad.

    The KL pairs as the policy's training passes will score them, batch by batch: each batch's scoring plan
    under ``ScoringRules.for_precompute`` (``folds``: ``pack_policy``), continued from the examples' cache or one
    shared-prompt pass. Equal within rounding either way; the same path keeps step-1 KL at 0 where the batches'
    shapes agree. ``images``: the collator's image keywords (``coati_kto.recipe.images``); a batch with images
    is scored in two padded passes, as the policy's, with one computation of its image features."""
    collator = KTOCollator(pad_token_id, **(images or {}))
    head = LMHead.find(model)
    rules = ScoringRules.for_precompute(model, kl_continuation, folds)
    device = next(model.parameters()).device
    out = np.zeros((len(order), 2), dtype=np.float32)
    with torch.inference_mode():  # no autograd bookkeeping at all (the trainer's passes need no_grad only)
        for s in range(0, len(order), batch_size):
            batch = collator([rows[int(i)] for i in order[s : s + batch_size]])
            plan = rules.plan(batch, train=True, alone=True)
            batch = batch.to(device)
            if plan.reference == "continued":
                example, kl = continued_logps(model, batch.example, batch.kl_continuation, head)
            elif plan.reference == "separate":  # images: padded passes (ScoringRules.plan)
                vision = shared_vision(batch, model, None, None)
                example, kl = (
                    view_logps(model, view, head, True, vision.keywords(model, k))
                    for k, view in ((False, batch.example), (True, batch.kl))
                )
            else:  # "packed": for_precompute packs the reference's pairs
                example, kl, _ = pair_logps(model, batch)
            out[s : s + len(example), 0] = example.float().cpu().numpy()
            out[s : s + len(example), 1] = kl.float().cpu().numpy()
    return out


def _gather_to_rank0(local: np.ndarray, n: int, rank: int, world: int) -> np.ndarray | None:
    """Rows rank, rank + world, ... from every rank, in dataset order, on rank 0 (one all_gather per split)."""
    if world == 1:
        return local
    per_rank = -(-n // world)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    padded = torch.full((per_rank, 2), float("nan"), dtype=torch.float32, device=device)
    padded[: len(local)] = torch.from_numpy(local).to(device)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    if rank != 0:
        return None
    out = np.empty((n, 2), dtype=np.float32)
    for r, part in enumerate(parts):
        out[r::world] = part[: len(range(r, n, world))].cpu().numpy()
    return out


def score_splits(
    settings: ReferenceSettings,
    splits: dict[str, Any],
    pad_token_id: int,
    images: dict[str, Any] | None = None,
) -> dict[str, np.ndarray] | None:
    """Every rank scores its share of every split with the reference of ``settings``; rank 0 gets the full arrays
    (others None). The reference is freed before returning: training never holds it."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    refuse_a_reference_no_gpu_holds(settings)
    model = load_reference(settings.model, settings.dtype)
    gathered = {}
    try:
        for split, rows in splits.items():
            mine = np.arange(rank, len(rows), world)
            lengths = np.asarray(rows["length"], dtype=np.int64) + np.asarray(
                rows["kl_length"], dtype=np.int64
            )
            order = mine[np.argsort(-lengths[mine], kind="stable")]  # similar lengths together: less padding
            scored = score_rows(
                model,
                rows,
                order,
                settings.kto.precompute_batch_size,
                pad_token_id,
                kl_continuation=settings.kto.kl_continuation,
                folds=settings.kto.policy_packing(),
                images=images,
            )
            local = scored[np.argsort(order)]  # back to this rank's row order (rank, rank + world, ...)
            gathered[split] = _gather_to_rank0(local, len(rows), rank, world)
    finally:
        del model  # training never holds the reference: free it before the policy is built
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return gathered if rank == 0 else None


def reference_over_device(settings: ReferenceSettings, device_bytes: int) -> str | None:
    """Why the whole reference cannot be scored on a device of ``device_bytes``: its weights alone in the run's
    dtype are larger (from config.json, as ``coati-kto plan`` counts them); None when they fit or the shape is
    unknown (a Hub id not in the cache yet: the load will tell)."""
    source = settings.model.reference_path or settings.model.path
    key = "model.reference_path" if settings.model.reference_path else "model.path"
    try:
        need = model_shape(source, key).params * settings.dtype.itemsize
    except UserError:
        return None
    if need <= device_bytes:
        return None
    return (
        f"kto.reference cached: scoring the reference cache holds the whole reference ({source}) on each GPU, "
        f"{need / 2**30:.1f} GiB of {str(settings.dtype).removeprefix('torch.')} weights, more than this GPU's "
        f"{device_bytes / 2**30:.1f} GiB; compute the cache (coati-kto precompute) where the whole reference fits "
        "one device, or use kto.reference: online (split over the layout like the policy)"
    )


def refuse_a_reference_no_gpu_holds(settings: ReferenceSettings) -> None:
    """UserError on every rank, before any weight is read, when one rank's GPU cannot hold the whole reference:
    an out-of-memory after each rank had read the whole model into host memory, otherwise. Every rank calls it
    (one all_reduce when distributed). No check on the CPU: the ranks share host memory, and nothing says how
    much of it is theirs."""
    if not torch.cuda.is_available():
        return
    device = torch.device("cuda", torch.cuda.current_device())
    why = reference_over_device(settings, torch.cuda.get_device_properties(device).total_memory)
    if dist.is_initialized():  # one rank's smaller GPU stops them all, not only itself (its peers would wait)
        on = device if dist.get_backend() == "nccl" else "cpu"
        vote = torch.tensor([why is not None], dtype=torch.int32, device=on)
        dist.all_reduce(vote, op=dist.ReduceOp.MAX)
        if vote.item() and why is None:
            why = (
                "kto.reference cached: another rank's GPU cannot hold the whole reference to score its cache"
            )
    if why is not None:
        raise UserError(why)
