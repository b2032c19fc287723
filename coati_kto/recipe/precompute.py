"""``coati-kto precompute CONFIG``: the reference log-probs of every example and KL pair, scored once and stored
with the prepared data (``kto.reference: cached`` reads them). Every rank calls ``precompute``."""

from __future__ import annotations

from coati_kto.config.schema import Config
from coati_kto.parallel.distributed import init_distributed
from coati_kto.recipe.setup import load_run_data, reference_settings
from coati_kto.runtime.host_memory import keep_freed_memory


def precompute(config: Config) -> None:
    """Prepare the data if needed, then make sure the reference cache matches it (computed when none does)."""
    from coati_kto.reference.cache import ensure_reference_cache

    init_distributed(config.train.dist_timeout, config.train.file_wait_timeout)
    keep_freed_memory()  # scoring on the CPU: freed memory kept for the next batch
    run_data = load_run_data(config)
    ensure_reference_cache(reference_settings(config), run_data.data, run_data.pad, run_data.images)
