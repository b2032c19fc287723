"""The prepared data as the commands get it: built or reused, opened, with the KTO weight report attached.

- :func:`prepare`: one process (``coati-kto prepare``); always prints the summary.
- :func:`load_prepared`: every rank of a run (``train``, ``precompute``; ``inspect`` on its one process):
  global rank 0 builds while the others wait, then every rank opens the same build.

Both return :class:`~coati_kto.data.store.PreparedData` whose ``stats`` is stats.json plus ``"imbalance"``:
:func:`coati_kto.data.weights.imbalance` for one rank and the current config, computed on opening because it
depends on settings the data fingerprint does not cover (``train.micro_batch_size``, ``kto.*``).
"""

from __future__ import annotations

import time
from pathlib import Path

from coati_kto.config.schema import Config
from coati_kto.data.store import (
    PreparedData,
    ensure,
    read_fingerprint,
    read_prepared,
    summary,
    train_data_digest,
)
from coati_kto.data.tokenize import load_tokenizer, pad_id
from coati_kto.data.weights import imbalance
from coati_kto.errors import ConfigError, DataError
from coati_kto.families import positions_problem, vocabulary_problem
from coati_kto.parallel.distributed import global_rank, on_rank0


def _open(config: Config) -> PreparedData:
    data = read_prepared(config)
    max_token_id = max((data.stats.get(split) or {}).get("max_token_id", 0) for split in ("train", "eval"))
    for key, path in (
        ("model.path", config.model.path),
        ("model.reference_path", config.model.reference_path),
    ):
        why = path and (
            vocabulary_problem(path, max_token_id) or positions_problem(path, _longest(config, data))
        )
        if why:
            raise ConfigError(f"{key} {why}")
    data.stats["imbalance"] = imbalance(config, data.stats, num_replicas=1)
    data.stats["train_data"] = train_data_digest(read_fingerprint(Path(config.data.prepared_dir)))
    return data


def _longest(config: Config, data: PreparedData) -> int:
    """The longest row a pass can hold: an example, or a KL row (one example's prompt, another's completion)."""
    lengths = [(data.stats.get(split) or {}).get("lengths", {}) for split in ("train", "eval")]
    prompt = max(int(s.get("prompt", {}).get("max", 0)) for s in lengths)
    completion = max(int(s.get("completion", {}).get("max", 0)) for s in lengths)
    return min(config.data.max_length, prompt + completion)


def _summary(data: PreparedData, config: Config, built: bool, why: str, seconds: float) -> str:
    """The store's summary, then the KTO weight report."""
    return f"{summary(data.stats, config, built, why, seconds)}\n  {data.stats['imbalance']['report']}"


def prepare(config: Config) -> PreparedData:
    """Build (or reuse) ``data.prepared_dir`` and print a short summary. Single process (CLI ``prepare``)."""
    start = time.perf_counter()
    tokenizer = load_tokenizer(config)
    _, built, why = ensure(config, tokenizer)
    data = _open(config)
    print(_summary(data, config, built, why, time.perf_counter() - start))
    return data


def load_prepared(config: Config) -> PreparedData:
    """For training: every rank calls it. Global rank 0 builds if needed while the others wait; then every rank
    loads from disk. A rank-0 failure is raised on every rank (``on_rank0``: nobody hangs in a collective).

    Long builds can outlast the process-group timeout: run ``coati-kto prepare`` before launching.
    """

    def build() -> str:
        start = time.perf_counter()
        tokenizer = load_tokenizer(config)
        fp, built, why = ensure(config, tokenizer)
        if built:
            print(_summary(_open(config), config, built, why, time.perf_counter() - start))
        elif pad_id(tokenizer)[1]:  # the summary says it when built; once per run either way
            print(pad_id(tokenizer)[1])
        return fp["digest"]

    digest = on_rank0(build, "prepare the data")
    target = Path(config.data.prepared_dir)
    found = (read_fingerprint(target) or {}).get("digest")
    if found != digest:
        raise DataError(
            f"data.prepared_dir {target}: rank {global_rank()} sees prepared data {found or 'missing'}, rank 0 "
            f"built {digest}: on multi-node runs put data.prepared_dir on a shared filesystem"
        )
    return _open(config)
