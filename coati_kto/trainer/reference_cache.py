"""Reference log-probs computed once and stored with the prepared data (``kto.reference: cached``).

``coati-kto precompute CONFIG`` (or ``train`` with ``kto.reference: cached`` when no cache matches) loads the
reference model, scores every train and eval example and its KL pair without gradient, the rows split over all
ranks at ``kto.precompute_batch_size``, and global rank 0 writes

    data.prepared_dir/reference_cache/<key digest>/{train,eval}.npy   float32 [rows, 2]: (example, KL pair)
    data.prepared_dir/reference_cache/<key digest>/meta.json          the key, row counts, file checksums

The key covers what changes the values: the prepared data (its fingerprint digest: files, tokenizer,
lengths, seed...), the reference weights by content (sha256 of the weight files and config.json, not the
path), the dtype, the attention implementation and the lengths. Anything else (beta, lambdas, lr, seed-free
settings, steps, the plugin layout) reuses the cache. A cache for another key is never used: the missing one
is computed and the reason said in one line; a damaged cache (unreadable, wrong shape, checksum mismatch) is
recomputed the same way. The directory appears by rename, complete or not at all. A rebuilt prepared_dir
starts without caches (they live inside it).
"""

from __future__ import annotations

import gc
import hashlib
import json
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from coati_kto.config.resume import check_contents
from coati_kto.config.schema import Config
from coati_kto.data.collator import KTOCollator
from coati_kto.data.prepared import load_prepared
from coati_kto.data.settings import PrepareSettings
from coati_kto.data.store import fingerprint, read_fingerprint, train_data_digest
from coati_kto.data.tokenize import load_tokenizer, pad_id
from coati_kto.data.weights import WeightSettings
from coati_kto.errors import ConfigError
from coati_kto.families import vocabulary_size
from coati_kto.models.continuation import continued_logps
from coati_kto.models.hf import load_reference
from coati_kto.models.lm_head import LMHead
from coati_kto.models.packing import pair_logps
from coati_kto.parallel.distributed import barrier, init_distributed, on_rank0
from coati_kto.parallel.plan import ParallelPlan
from coati_kto.runtime.host_memory import keep_freed_memory
from coati_kto.trainer.scoring_plan import ScoringRules

CACHE_VERSION = 1  # bump when the stored values change for the same key
CACHE_DIR = "reference_cache"
SPLITS = ("train", "eval")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")  # plus config.json: what the forward depends on
_SAMPLE = 1 << 20  # bytes per sampled block of a weight file (reference_weights_digest)


# ----------------------------------------------------------------------------------------------- the key
def _weights_dir(path: str) -> Path:
    local = Path(path)
    if local.is_dir():
        return local
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path, local_files_only=True))
    except Exception:  # noqa: BLE001 - any failure means: not on disk
        raise ConfigError(
            f"model.reference_path / model.path {path}: kto.reference cached fingerprints the reference "
            "weights by content and needs them on disk (a directory or a downloaded hub snapshot)"
        ) from None


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def weights_hash(path: str, memo_file: Path | None = None) -> str:
    """sha256 over the reference's weight files and config.json (names and contents).

    ``memo_file`` remembers each file's hash under (path, size, mtime, ctime, inode), so a multi-GB model is
    read once, not at every launch. A file that changes is hashed again, even with the same size and mtime (a
    checkpoint of the same shapes extracted or copied with its timestamps: ``tar``, ``cp -p``, ``rsync -t``):
    nothing but the kernel sets ctime, and a write or a replacing rename changes it or the inode.
    """
    root = _weights_dir(path)
    memo: dict[str, str] = {}
    if memo_file is not None and memo_file.is_file():
        try:
            memo = json.loads(memo_file.read_text())
        except ValueError:
            memo = {}
    h = hashlib.sha256()
    files = sorted(
        f
        for f in root.rglob("*")
        if f.is_file() and (f.suffix in _WEIGHT_SUFFIXES or f.name == "config.json")
    )
    for f in files:
        st = f.stat()
        stamp = f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}"
        if stamp not in memo:
            memo[stamp] = _file_sha256(f)
        h.update(f"{f.relative_to(root)}\0{memo[stamp]}\0".encode())
    if memo_file is not None:
        try:
            memo_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo_file.with_name(f".{memo_file.name}.{uuid.uuid4().hex[:8]}")
            tmp.write_text(json.dumps(memo, indent=1))
            tmp.replace(memo_file)
        except (
            OSError
        ):  # a read-only prepared_dir (an online run writes nothing else there): hashed next time
            pass
    return h.hexdigest()


def reference_weights_digest(config: Config) -> str | None:
    """The run's reference weights (``model.reference_path`` or ``model.path``) by a sample of their content,
    which a resume compares with the checkpoint's (a new SFT run saved over the reference changes every
    sample): None where the reference is not read from disk (LoRA with an online reference: the checkpoint's
    own base, adapters off) or is not on disk. Reads at most 16 MiB per file, so a 70B reference costs a
    second, not a full hash while the other ranks wait. Every rank calls; global rank 0 reads."""
    if config.model.lora is not None and config.kto.reference == "online":
        return None

    def digest() -> str | None:
        try:
            root = _weights_dir(config.model.reference_path or config.model.path)
        except ConfigError:
            return None
        h = hashlib.sha256()
        # Top level only, as from_pretrained reads it: not an output.dir, an export or Trainer's checkpoint-N/
        # kept under the model's directory (a run's own checkpoints there changed the digest at every save).
        for f in sorted(p for p in root.iterdir() if p.is_file() and p.suffix in _WEIGHT_SUFFIXES):
            size = f.stat().st_size
            h.update(f"{f.relative_to(root)}\0{size}\0".encode())
            with f.open("rb") as handle:  # 16 blocks of 1 MiB spread over the file, its header first
                for offset in sorted({i * max(0, size - _SAMPLE) // 15 for i in range(16)}):
                    handle.seek(offset)
                    h.update(handle.read(_SAMPLE))
        return h.hexdigest()

    return on_rank0(digest, "read the reference weights")


def refuse_changed_contents(config: Config, checkpoints: Path) -> None:
    """train.resume from a checkpoint (under ``checkpoints``) whose training data (files edited in place, another
    tokenizer) or reference weights changed since: refused (``check_contents``) before data.prepared_dir is
    rebuilt, deleting the reference cache the checkpoint's run needs, and the new data scored. Every rank calls."""
    from coati_kto.runtime.run_dir import resolve_checkpoint, saved_trainer_state

    resume = config.train.resume
    checkpoint = on_rank0(lambda: resolve_checkpoint(checkpoints, resume), "resolve the checkpoint")
    if checkpoint is None:
        return
    try:
        state = saved_trainer_state(checkpoint)["trainer_state"]
    except FileNotFoundError:
        return
    inputs = PrepareSettings(config.data, config.model, config.train.seed)
    data = on_rank0(
        lambda: train_data_digest(fingerprint(inputs, load_tokenizer(inputs.model))), "hash the data"
    )
    check_contents(
        state, {"train_data": data, "reference_weights": reference_weights_digest(config)}, checkpoint.name
    )


def cache_key(config: Config, data_digest: str, reference_weights: str) -> dict[str, Any]:
    """What decides the cached values; ``digest`` names the cache directory."""

    key: dict[str, Any] = {
        "version": CACHE_VERSION,
        "data": data_digest,
        "reference_weights": reference_weights,
        "dtype": str(ParallelPlan.from_config(config).dtype).removeprefix("torch."),
        "attn_implementation": config.model.attn_implementation or "default",
        "max_length": config.data.max_length,
        "max_prompt_length": config.data.max_prompt_length,
        "scored_tokens": "completion",  # KTOTrainer's apply_loss_mask=True, what train builds
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
        if meta.get("files", {}).get(split) != (_file_sha256(path) if path.is_file() else None):
            raise ValueError(f"{split}.npy missing or its checksum differs from meta.json")
        values = np.load(path, allow_pickle=False)
        if values.shape != (n, 2) or values.dtype != np.float32:
            raise ValueError(f"{split}.npy is {values.dtype} {values.shape}, expected float32 ({n}, 2)")
        out[split] = values
    return out


def _write(directory: Path, key: dict, values: dict[str, np.ndarray], seconds: float) -> None:
    """Write into a temporary sibling, then rename into place (global rank 0 only)."""
    work = directory.with_name(f".{directory.name}.tmp-{uuid.uuid4().hex[:8]}")
    work.mkdir(parents=True)
    try:
        files = {}
        for split, array in values.items():
            np.save(work / f"{split}.npy", array.astype(np.float32), allow_pickle=False)
            files[split] = _file_sha256(work / f"{split}.npy")
        meta = {
            "key": key,
            "rows": {s: len(v) for s, v in values.items()},
            "files": files,
            "seconds": seconds,
        }
        (work / "meta.json").write_text(json.dumps(meta, indent=2))
        if directory.exists():
            shutil.rmtree(directory)
        work.rename(directory)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _why_missing(root: Path, key: dict) -> str:
    """One phrase: what differs from the newest other cache (so a recomputation is never silent)."""
    metas = []
    for meta_file in root.glob("*/meta.json"):
        try:
            metas.append((meta_file.stat().st_mtime, json.loads(meta_file.read_text())["key"]))
        except (OSError, ValueError, KeyError):
            continue
    if not metas:
        return "no cache yet"
    other = max(metas, key=lambda m: m[0])[1]
    changed = [k for k in key if k != "digest" and other.get(k) != key[k]]
    return f"the cache {other.get('digest')} is for another {', '.join(changed) or 'key'}"


# ------------------------------------------------------------------------------------------------ compute
def score_rows(
    model: torch.nn.Module,
    rows: Any,
    order: np.ndarray,
    batch_size: int,
    pad_token_id: int,
    kl_continuation: bool = False,
    folds: bool = False,
):
    """Reference (example, KL pair) log-probs of ``rows[order]``: float32 [len(order), 2]. No grad.

    The KL pairs as the policy's training passes will score them, batch by batch: each batch's scoring plan
    under ``ScoringRules.for_precompute`` (``folds``: ``pack_policy``), continued from the examples' cache or one
    shared-prompt pass. Equal within rounding either way; the same path keeps step-1 KL at 0 where the batches'
    shapes agree."""
    collator = KTOCollator(pad_token_id)
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


def _compute(config: Config, splits: dict[str, Any], pad_token_id: int) -> dict[str, np.ndarray] | None:
    """Every rank scores its share of every split; rank 0 gets the full arrays (others None)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    model = load_reference(config.model, ParallelPlan.from_config(config).dtype)
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
                config.kto.precompute_batch_size,
                pad_token_id,
                kl_continuation=config.kto.kl_continuation,
                folds=config.kto.policy_packing(),
            )
            local = scored[np.argsort(order)]  # back to this rank's row order (rank, rank + world, ...)
            gathered[split] = _gather_to_rank0(local, len(rows), rank, world)
    finally:
        del model  # training never holds the reference: free it before the policy is built
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return gathered if rank == 0 else None


# ------------------------------------------------------------------------------------------------ public
def ensure_reference_cache(config: Config, data: Any, pad_token_id: int) -> dict[str, np.ndarray]:
    """The cached reference log-probs {split: float32 [rows, 2]}, computed first when none matches.

    Every rank calls it after ``load_prepared`` (collectives inside). Prints one line on global rank 0.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    prepared = Path(config.data.prepared_dir)
    root = prepared / CACHE_DIR
    splits = {s: ds for s, ds in (("train", data.train), ("eval", data.eval)) if ds is not None and len(ds)}
    rows = {s: len(ds) for s, ds in splits.items()}

    def look_up() -> tuple[str, dict, str]:
        digest = (read_fingerprint(prepared) or {})["digest"]
        memo = root / "weights_sha256.json"
        key = cache_key(config, digest, weights_hash(config.model.reference_path or config.model.path, memo))
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
        values = _compute(config, splits, pad_token_id)
        if rank == 0:
            _write(directory, key, values, time.perf_counter() - start)
        barrier()
    elif rank == 0:
        print(f"reference log-probs: reusing {directory}", flush=True)
    return _read(directory, key, rows)


def with_reference_logps(config: Config, data: Any, pad_token_id: int) -> Any:
    """``data`` with reference_logps / reference_kl_logps columns (the collator passes them to the trainer)."""
    values = ensure_reference_cache(config, data, pad_token_id)
    for split in SPLITS:
        ds = getattr(data, split)
        if ds is not None and split in values:
            ds = ds.add_column("reference_logps", values[split][:, 0].astype(np.float32).tolist())
            ds = ds.add_column("reference_kl_logps", values[split][:, 1].astype(np.float32).tolist())
            setattr(data, split, ds)
    return data


def precompute(config: Config) -> None:
    """``coati-kto precompute``: prepare the data if needed, then make sure the reference cache matches."""

    init_distributed(timeout_s=config.train.dist_timeout)
    keep_freed_memory()  # scoring on the CPU: freed memory kept for the next batch
    inputs = PrepareSettings(config.data, config.model, config.train.seed)
    data = load_prepared(inputs, WeightSettings(config.kto, config.train.micro_batch_size))
    vocabulary = vocabulary_size(config.model.path, config.model.reference_path)
    ensure_reference_cache(config, data, pad_id(load_tokenizer(config.model), vocabulary)[0])
