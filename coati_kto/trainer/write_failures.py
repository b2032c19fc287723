"""Failed writes of a checkpoint: held inside ColossalAI's save until it returns, and described in one line.

Upstream's sharded saves interleave collectives with one rank's file writes: the optimizer's states are gathered
over the data-parallel group a shard at a time and the writing rank saves each shard before the next gather
(``save_state_dict_shards``), and the low-level ZeRO backend writes its param groups before any gather. A write that raised
there took the writing rank out of the save, into the checkpoint's failure agreement, while its peers went on
into upstream's next gather: the collectives no longer lined up, and the peers waited ``train.dist_timeout``
(NCCL's watchdog aborts them) instead of raising the failure at once.

Inside :func:`held_write_failures` the writing rank stays in step: its first failed write is recorded, its later
writes in the same save are skipped (the partial checkpoint is removed anyway), every collective is still
reached, and the failure is raised once upstream's save returns.
"""

from __future__ import annotations

import functools
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# The writers upstream's checkpoint IO calls (looked up at call time, so patching the attribute reaches every
# call site): torch.save (pickled shards, param groups, the scheduler), safetensors' save_file (safetensors
# shards), the index file's writer, and the model's config.json and generation_config.json (save_config_file,
# on the writing rank after its shards: under ZeRO the peers go on into the optimizer's gathers meanwhile).
_WRITERS: tuple[tuple[str, str], ...] = (
    ("torch", "save"),
    ("safetensors.torch", "save_file"),
    ("colossalai.checkpoint_io.index_file", "CheckpointIndexFile.write_index_file"),
    ("transformers.configuration_utils", "PretrainedConfig.save_pretrained"),
    ("transformers.generation.configuration_utils", "GenerationConfig.save_pretrained"),
)


@contextmanager
def held_write_failures() -> Iterator[None]:
    """Every rank calls it around the booster's saves. On this thread, a write that raises is recorded and the
    save goes on (later writes skipped); on leaving, the first recorded failure is raised. Other threads' writes
    (uploads, loggers) are untouched."""
    import importlib

    owner = threading.get_ident()
    failures: list[BaseException] = []

    def hold(write: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(write)
        def held(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != owner:
                return write(*args, **kwargs)
            if failures:
                return None  # this checkpoint is already lost: write nothing more of it
            try:
                return write(*args, **kwargs)
            except Exception as err:  # noqa: BLE001 - raised again when the save returns
                failures.append(err)
                return None

        return held

    patched: list[tuple[Any, str, Any]] = []
    for module_name, path in _WRITERS:
        owner_obj: Any = importlib.import_module(module_name)
        *parents, name = path.split(".")
        for parent in parents:
            owner_obj = getattr(owner_obj, parent)
        original = owner_obj.__dict__[name] if isinstance(owner_obj, type) else getattr(owner_obj, name)
        patched.append((owner_obj, name, original))
        setattr(owner_obj, name, hold(original))
    try:
        yield
    finally:
        for owner_obj, name, original in reversed(patched):
            setattr(owner_obj, name, original)
    if failures:
        raise failures[0]


def with_disk_hint(err: BaseException, root: Path) -> BaseException:
    """torch.save's file writer turns ENOSPC and EIO into ``RuntimeError: ... unexpected pos A vs B``: name the
    cause from the filesystem's free space instead (an OSError :func:`describe` prints in one line)."""
    if isinstance(err, OSError) or "unexpected pos" not in str(err):
        return err
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return err
    hint = "No space left on device" if free < (1 << 20) else "write failed (I/O error?)"
    return OSError(0, f"{hint}: {free} bytes free under {root} ({str(err).strip().splitlines()[0]})")


def describe(err: BaseException) -> str:
    """``No space left on device: /ckpt/step-4.tmp/model`` for an OSError; the first line of others."""
    if isinstance(err, OSError) and err.strerror:
        where = f": {err.filename}" if err.filename else ""
        return f"{err.strerror}{where}"
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__
