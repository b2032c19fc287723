"""The prepared data as the commands get it: built or reused, opened, with the KTO weight report attached.

- :func:`prepare`: one process (``coati-kto prepare``); always prints the summary.
- :func:`load_prepared`: every rank of a run (``train``, ``precompute``; ``inspect`` on its one process):
  global rank 0 builds while the others wait, then every rank opens the same build.

Both take the :class:`~coati_kto.data.settings.PrepareSettings` and the
:class:`~coati_kto.data.weights.WeightSettings` of the config, and return
:class:`~coati_kto.data.prepared_read.PreparedData` whose ``stats`` is stats.json plus ``"imbalance"``:
:func:`coati_kto.data.weights.imbalance` for one rank and the current config, computed on opening because it
depends on settings the data fingerprint does not cover (``train.micro_batch_size``, ``kto.*``).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from coati_kto.data.prepared_lock import release
from coati_kto.data.prepared_read import PreparedData, read_prepared
from coati_kto.data.settings import PrepareSettings
from coati_kto.data.store import NO_BUILD, build_reason, ensure, read_fingerprint
from coati_kto.data.summary import summary
from coati_kto.data.tokenize import load_tokenizer
from coati_kto.data.train_data import train_data_digest, train_data_parts
from coati_kto.data.vocabulary import model_pad_id
from coati_kto.data.weights import WeightSettings, imbalance
from coati_kto.errors import ConfigError, DataError
from coati_kto.families import positions_problem, vocabulary_problem
from coati_kto.parallel.distributed import global_rank, on_rank0


def _open(settings: PrepareSettings, weights: WeightSettings) -> PreparedData:
    """The complete build, refused (ConfigError) when a checkpoint lacks its token ids or positions."""
    data = read_prepared(settings.data.prepared_dir)
    max_token_id = max((data.stats.get(split) or {}).get("max_token_id", 0) for split in ("train", "eval"))
    longest = _longest(settings.data.max_length, data)
    for key, path in (
        ("model.path", settings.model.path),
        ("model.reference_path", settings.model.reference_path),
    ):
        why = path and (vocabulary_problem(path, max_token_id) or positions_problem(path, longest))
        if why:
            raise ConfigError(f"{key} {why}")
    data.stats["imbalance"] = imbalance(weights, data.stats, num_replicas=1)
    fp = read_fingerprint(Path(settings.data.prepared_dir))
    data.stats["train_data"], data.stats["train_data_parts"] = train_data_digest(fp), train_data_parts(fp)
    return data


def _longest(max_length: int, data: PreparedData) -> int:
    """The longest row a pass can hold: an example, or a KL row (one example's prompt, another's completion)."""
    lengths = [(data.stats.get(split) or {}).get("lengths", {}) for split in ("train", "eval")]
    prompt = max(int(s.get("prompt", {}).get("max", 0)) for s in lengths)
    completion = max(int(s.get("completion", {}).get("max", 0)) for s in lengths)
    return min(max_length, prompt + completion)


def _summary(data: PreparedData, settings: PrepareSettings, built: bool, why: str, seconds: float) -> str:
    """The store's summary, then the KTO weight report."""
    return f"{summary(data.stats, settings.data, built, why, seconds)}\n  {data.stats['imbalance']['report']}"


def prepare(settings: PrepareSettings, weights: WeightSettings) -> PreparedData:
    """Build (or reuse) ``data.prepared_dir`` and print a short summary. Single process (CLI ``prepare``); it uses
    the build until it returns (``prepared_lock``)."""
    start = time.perf_counter()
    try:
        tokenizer = load_tokenizer(settings.model)
        _, built, why = ensure(settings, tokenizer)
        data = _open(settings, weights)
        print(_summary(data, settings, built, why, time.perf_counter() - start))
    finally:
        release(Path(settings.data.prepared_dir))
    return data


def load_prepared(settings: PrepareSettings, weights: WeightSettings) -> PreparedData:
    """For training: every rank calls it. Global rank 0 builds if needed while the others wait; then every rank
    loads from disk. A rank-0 failure is raised on every rank (``on_rank0``: nobody hangs in a collective).
    Global rank 0 uses the build until the command calls ``prepared_lock.release``: no other process replaces it.

    Long builds can outlast the process-group timeout: run ``coati-kto prepare`` before launching.
    """

    def build() -> str:
        start = time.perf_counter()
        tokenizer = load_tokenizer(settings.model)
        fp, built, why = ensure(settings, tokenizer)
        if built:  # the store's summary; the run prints the KTO weights for its own layout (recipe.setup)
            stats = _open(settings, weights).stats
            print(summary(stats, settings.data, built, why, time.perf_counter() - start))
        elif note := model_pad_id(tokenizer, settings.model)[1]:  # the summary says it when built; once a run
            print(note)
        return fp["digest"]

    digest = on_rank0(build, "prepare the data")
    target = Path(settings.data.prepared_dir)
    found = (read_fingerprint(target) or {}).get("digest")
    if found != digest:
        rank = global_rank()
        replaced = (
            "another process replaced it meanwhile: a run or prepare of other data settings on the same "
            "data.prepared_dir (give each its own)"
        )
        shared = (
            "on multi-node runs put data.prepared_dir on a shared filesystem; on one filesystem, " + replaced
        )
        raise DataError(
            f"data.prepared_dir {target}: rank {rank} sees prepared data {found or 'missing'}, rank 0 built "
            f"{digest}: {replaced if rank == 0 else shared}"
        )
    return _open(settings, weights)


def elsewhere(
    settings: PrepareSettings, scratch: Path, command: str, missing_too: bool
) -> tuple[PrepareSettings, str]:
    """For a command that must not replace ``data.prepared_dir`` (``inspect``, ``export``): ``settings`` as they
    are and '' when the directory holds their build (or none yet, unless ``missing_too``); else ``settings``
    pointed at ``scratch``, which the caller removes, and a line saying so. Prepare would replace the build (and
    drop its reference caches, hours of scoring). One process; writes nothing."""
    why = build_reason(settings, load_tokenizer(settings.model))
    if why is None or (why == NO_BUILD and not missing_too):
        return settings, ""
    here = settings.data.prepared_dir
    note = (
        f"data.prepared_dir {here} does not hold this data ({why}): {command} prepares it in {scratch} and removes "
        f"it at the end; {here} is left as it is"
    )
    data = settings.data.model_copy(update={"prepared_dir": str(scratch)})
    return dataclasses.replace(settings, data=data), note
