"""``coati-kto precompute CONFIG``: the reference log-probs of every example and KL pair, scored once and stored
with the prepared data (``kto.reference: cached`` reads them). Every rank calls ``precompute``.

A stop signal (SIGTERM, Ctrl-C) ends it at once: there is no partial cache to keep. The CLI gives it
``STOP.quit_on_stop``; the cache's temporary directory is removed on the way out, the caches already there are
left as they were, and the process exits 128 + the signal after one line."""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

from coati_kto.config.schema import Config
from coati_kto.data.prepared_lock import release
from coati_kto.errors import ConfigError
from coati_kto.parallel.distributed import init_distributed
from coati_kto.recipe.setup import load_run_data, reference_settings
from coati_kto.runtime.host_memory import keep_freed_memory
from coati_kto.runtime.preflight import check_precomputing
from coati_kto.runtime.signals import STOP


def precompute(config: Config) -> None:
    """Prepare the data if needed, then make sure the reference cache matches it (computed when none does)."""
    STOP.leaves("no reference cache written")
    try:
        STOP.stoppable(lambda: _precompute(config))
    finally:  # global rank 0 used the build while it scored it (prepared_lock): nobody replaced it meanwhile
        release(Path(config.data.prepared_dir))


def _precompute(config: Config) -> None:
    from coati_kto.reference.cache import CACHE_DIR, ensure_reference_cache

    try:
        check_precomputing(config)  # before anything heavy: every problem at once, and nothing else said
    except ConfigError as err:
        # what it reads may differ between nodes (node-local disks): each node's first rank says its own
        err.same_on_every_rank = os.environ.get("LOCAL_RANK", "0") != "0"
        raise
    init_distributed(config.train.dist_timeout, config.train.file_wait_timeout)
    keep_freed_memory()  # scoring on the CPU: freed memory kept for the next batch
    run_data = load_run_data(config)
    if config.kto.reference != "cached" and dist.get_rank() == 0:
        # Said before the scoring, which can take hours: training with this config would never read the cache.
        # After the data is read: a user error there (a malformed record) is the command's only line.
        print(
            f"note: kto.reference is {config.kto.reference}: train scores the reference as it goes and does not read "
            "this cache; train with kto.reference=cached to use it",
            flush=True,
        )
    # From here prepared_dir stays as it is (a rebuild, which starts without caches, is done); until the new
    # cache is renamed in (reference.cache), a stop leaves the others untouched.
    caches = Path(config.data.prepared_dir) / CACHE_DIR
    STOP.leaves(f"no reference cache written; the caches under {caches} are as they were")
    ensure_reference_cache(reference_settings(config), run_data.data, run_data.pad, run_data.images)
