"""Reference log-probs computed once and stored with the prepared data (``kto.reference: cached``).

``coati-kto precompute CONFIG`` (or ``train`` with ``kto.reference: cached`` when no cache matches) loads the
reference model, scores every train and eval example and its KL pair without gradient, the rows split over all
ranks at ``kto.precompute_batch_size``, and global rank 0 writes

    data.prepared_dir/reference_cache/<key digest>/{train,eval}.npy   float32 [rows, 2]: (example, KL pair)
    data.prepared_dir/reference_cache/<key digest>/meta.json          the key, row counts, file checksums

The key covers what changes the values: the prepared data (its fingerprint digest: files, tokenizer,
lengths, seed...), the reference weights by content (sha256 of the weight files, config.json and the code a
model ships, not the path), the dtype, the attention implementation, the lengths, and whether the trained fp32 parameters are rounded
to the working dtype (a full run's, not LoRA's). Anything else (beta, lambdas, lr, seed-free
settings, steps, the plugin layout) reuses the cache. A cache for another key is never used: the missing one
is computed and the reason said in one line; a damaged cache (unreadable, wrong shape, checksum mismatch) is
recomputed the same way. The directory appears by rename, complete or not at all. A rebuilt prepared_dir
starts without caches (they live inside it).

The directory is written in ``.DIGEST.tmp-PID-XXXXXXXX``, held by its writer's flock (coati_kto.data.build_folder,
as prepare's work folders): a writer killed mid-write (SIGKILL, the OOM killer) leaves it, and the next look-up
(precompute, or train with ``kto.reference: cached``) removes every such folder whose writer is gone, said in one
line; a live writer's (another job sharing the prepared data) is left alone. A damaged cache a writer renamed aside to
replace it (``.DIGEST.old-XXXXXXXX``, its build folder's XXXXXXXX), which a kill kept it from deleting, goes the
same way.

The write's outcome reaches every rank (``on_rank0``): a failed write (disk full, permission) is one line on
global rank 0 and ends every rank at once, exit 2, instead of leaving them waiting for train.file_wait_timeout.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from coati_kto.data.build_folder import aside, build_folder, remove_abandoned_in, removed_line
from coati_kto.errors import UserError
from coati_kto.parallel.distributed import on_rank0
from coati_kto.reference.scoring import score_splits
from coati_kto.reference.settings import ReferenceSettings
from coati_kto.reference.weights import file_sha256, weights_hash
from coati_kto.runtime.signals import STOP
from coati_kto.trainer.write_failures import describe

CACHE_VERSION = 1  # bump when the stored values change for the same key
CACHE_DIR = "reference_cache"
SPLITS = ("train", "eval")


# ----------------------------------------------------------------------------------------------- the key
def cache_key(settings: ReferenceSettings, data_digest: str, reference_weights: str) -> dict[str, Any]:
    """What decides the cached values; ``digest`` names the cache directory."""
    key: dict[str, Any] = {
        "version": CACHE_VERSION,
        "data": data_digest,
        "reference_weights": reference_weights,
        "dtype": str(settings.dtype).removeprefix("torch."),
        "attn_implementation": settings.model.attn_implementation or "default",
        "max_length": settings.data.max_length,
        "max_prompt_length": settings.data.max_prompt_length,
        "scored_tokens": "completion",  # KTOTrainer's apply_loss_mask=True, what train builds
        # Trained in full (no LoRA), the fp32 parameters the policy trains (MoE routers) run in the working dtype,
        # and so does the reference that precompute loads (models.hf.load_reference): other values than a LoRA
        # run's reference keeps in fp32.
        "trainable_rounded": settings.model.lora is None and settings.dtype != torch.float32,
    }
    key["digest"] = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return key


# ----------------------------------------------------------------------------------------- read / write
def _read(directory: Path, key: dict, rows: dict[str, int]) -> dict[str, np.ndarray]:
    """The cached arrays, checked against ``key``, row counts and checksums; ValueError says what is wrong."""
    try:
        meta = json.loads((directory / "meta.json").read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"meta.json unreadable ({type(err).__name__})") from None
    if meta.get("key") != key:
        raise ValueError("meta.json holds another key")
    out = {}
    for split, n in rows.items():
        path = directory / f"{split}.npy"
        if meta.get("files", {}).get(split) != (file_sha256(path) if path.is_file() else None):
            raise ValueError(f"{split}.npy missing or its checksum differs from meta.json")
        values = np.load(path, allow_pickle=False)
        if values.shape != (n, 2) or values.dtype != np.float32:
            raise ValueError(f"{split}.npy is {values.dtype} {values.shape}, expected float32 ({n}, 2)")
        out[split] = values
    return out


def _write(directory: Path, key: dict, values: dict[str, np.ndarray], seconds: float) -> None:
    """Write into a locked build folder beside ``directory``, then rename into place (global rank 0 only). A stop
    signal that ends precompute (``STOP.quit_on_stop``) removes the build folder, or waits for the rename; a kill
    leaves it to the next look-up's sweep (``_sweep``). A failed write (disk full, permission) raises UserError,
    one line: the build folder is removed, the caches there are as they were."""
    try:
        _write_in_folder(directory, key, values, seconds)
    except OSError as err:
        raise UserError(
            f"the reference cache could not be written to {directory} ({describe(err)}); nothing of it was kept, "
            f"the other caches under {directory.parent} are as they were"
        ) from None


def _write_in_folder(directory: Path, key: dict, values: dict[str, np.ndarray], seconds: float) -> None:
    with build_folder(directory, "the reference cache") as work:
        files = {}
        for split, array in values.items():
            np.save(work / f"{split}.npy", array.astype(np.float32), allow_pickle=False)
            files[split] = file_sha256(work / f"{split}.npy")
        meta = {
            "key": key,
            "rows": {s: len(v) for s, v in values.items()},
            "files": files,
            "seconds": seconds,
        }
        (work / "meta.json").write_text(json.dumps(meta, indent=2))
        with STOP.held():  # the damaged cache out and this one in, then the stop's line says it is complete
            _replace(directory, work, key, meta["rows"])
            STOP.leaves(f"the reference cache {directory} is complete")


def _sweep(root: Path) -> None:
    """Remove the build folders under ``root`` whose writer was killed, whatever their key (a key never computed
    again would keep its leftover for good), in one line. Global rank 0 only: the one writer of ``root``."""
    if removed := remove_abandoned_in(root):
        print(removed_line(f"the reference cache {root}", removed), flush=True)


def _replace(directory: Path, work: Path, key: dict, rows: dict[str, int]) -> None:
    """``work`` renamed to ``directory``. One already there that reads whole (another job sharing the prepared
    data wrote the same key meanwhile) is kept: deleting it would pull its files from under that job's readers. A
    damaged one is renamed aside first, so a reader finds a whole cache or none, then deleted (named after
    ``work``: a kill before the deletion leaves it to the sweep, which takes it once ``work``'s lock is free)."""
    if directory.exists():
        try:
            _read(directory, key, rows)
            return
        except ValueError:
            damaged = aside(work, directory)
            directory.rename(damaged)
            work.rename(directory)
            shutil.rmtree(damaged, ignore_errors=True)
            return
    work.rename(directory)


def _why_missing(root: Path, key: dict) -> str:
    """One phrase: what differs from the newest other cache (so a recomputation is never silent)."""
    metas = []
    for meta_file in root.glob("*/meta.json"):
        if meta_file.parent.name.startswith("."):  # a write in progress or left by a kill, or one set aside
            continue
        try:
            metas.append((meta_file.stat().st_mtime, json.loads(meta_file.read_text())["key"]))
        except (OSError, ValueError, KeyError):
            continue
    if not metas:
        return "no cache yet"
    other = max(metas, key=lambda m: m[0])[1]
    changed = [k for k in key if k != "digest" and other.get(k) != key[k]]
    return f"the cache {other.get('digest')} is for another {', '.join(changed) or 'key'}"


# ------------------------------------------------------------------------------------------------ public
def ensure_reference_cache(
    settings: ReferenceSettings, data: Any, pad_token_id: int, images: dict[str, Any] | None = None
) -> dict[str, np.ndarray]:
    """The cached reference log-probs {split: float32 [rows, 2]}, computed first when none matches (``images``:
    the collator's image keywords where the rows hold images; their digests are in the data's fingerprint).

    Every rank calls it after ``load_prepared`` (collectives inside). Prints one line on global rank 0.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    prepared = Path(settings.data.prepared_dir)
    root = prepared / CACHE_DIR
    splits = {s: ds for s, ds in (("train", data.train), ("eval", data.eval)) if ds is not None and len(ds)}
    rows = {s: len(ds) for s, ds in splits.items()}

    def look_up() -> tuple[str, dict, str]:
        _sweep(root)
        # the opened build's digest: the directory's fingerprint, read again here, may be a build another process
        # swapped in since (other data settings on the same data.prepared_dir), and key these rows' values to it
        digest = data.stats["fingerprint"]
        memo = root / "weights_sha256.json"
        reference = settings.model.reference_path or settings.model.path
        key = cache_key(settings, digest, weights_hash(reference, memo))
        try:
            _read(root / key["digest"], key, rows)
            return "hit", key, ""
        except ValueError as err:
            damaged = (root / key["digest"]).exists()
            return "compute", key, f"the cache is damaged ({err})" if damaged else _why_missing(root, key)

    kind, key, why = on_rank0(look_up, "check the reference cache")
    directory = root / key["digest"]
    if kind == "compute":
        if rank == 0:
            print(
                f"reference log-probs: computing {sum(rows.values())} examples and their KL pairs on {world} "
                f"rank{'s' * (world > 1)} ({why}) -> {directory}",
                flush=True,
            )
        start = time.perf_counter()
        values = score_splits(settings, splits, pad_token_id, images)
        seconds = time.perf_counter() - start
        # Its outcome reaches every rank, a failure too (its one line on rank 0, the same error on the others): a
        # wait that only a success ended left them waiting train.file_wait_timeout where nothing told them.
        on_rank0(lambda: _write(directory, key, values, seconds), "write the reference cache")
    elif rank == 0:
        print(f"reference log-probs: reusing {directory}", flush=True)
    return _read(directory, key, rows)


def with_reference_logps(
    settings: ReferenceSettings, data: Any, pad_token_id: int, images: dict[str, Any] | None = None
) -> Any:
    """``data`` with reference_logps / reference_kl_logps columns (the collator passes them to the trainer)."""
    values = ensure_reference_cache(settings, data, pad_token_id, images)
    for split in SPLITS:
        ds = getattr(data, split)
        if ds is not None and split in values:
            ds = ds.add_column("reference_logps", values[split][:, 0].astype(np.float32).tolist())
            ds = ds.add_column("reference_kl_logps", values[split][:, 1].astype(np.float32).tolist())
            setattr(data, split, ds)
    return data
