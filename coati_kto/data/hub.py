"""Feedback data from the Hugging Face Hub: the ``hf://datasets/OWNER/NAME?config=C&split=S&revision=R`` entries
of ``data.train_files`` / ``data.eval_files`` (syntax: :mod:`coati_kto.config.hub`), read through ``datasets`` and
its cache (HF_HOME / HF_DATASETS_CACHE).

:func:`check` resolves the revision to its commit sha and checks the dataset, config, split and access before
anything is downloaded (one line each: preflight and the prepared data's fingerprint call it); :func:`open_split`
then loads exactly that commit. Online, both ask the Hub (one repo-info request, the card and file listing, one
HEAD of a data file); under HF_HUB_OFFLINE they read only the caches: the sha a branch or tag pointed at when it
was last loaded (huggingface_hub's refs), and the split ``datasets`` prepared for that sha.
A token is passed on by huggingface_hub (HF_TOKEN or the token file); messages say whether one is set, never it.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from coati_kto.config.hub import HubDataset, hub_offline, hub_token
from coati_kto.errors import DataError

SHA = re.compile(r"[0-9a-f]{40}")
_LOGIN = "HF_TOKEN, or `hf auth login`"


def pinned(spec: HubDataset, sha: str) -> str:
    """The entry with its revision replaced by the commit it resolved to (what stats.json and the card name)."""
    return replace(spec, revision=sha).source


def check(spec: HubDataset, key: str) -> str:
    """The commit sha ``spec.revision`` names, once the dataset, its config and split exist and are readable.
    Raises DataError (one line) otherwise. Downloads no data (the card and listings only)."""
    where = f"{key}: {spec.source}"
    sha = _cached_sha(spec) if hub_offline() else _hub_sha(spec, where)
    if sha is None:
        raise DataError(
            f"{where}: revision {spec.revision} is not in the Hugging Face cache and HF_HUB_OFFLINE is set "
            "(load it once online, or pin a cached commit sha)"
        )
    if hub_offline():
        splits = _cached_splits(spec, sha, where)
    else:
        splits, first_file = _hub_splits(spec, sha, where)
        _check_access(spec, first_file, where)
    missing = [name for name in spec.split_names if name not in splits]
    if missing:
        raise DataError(f"{where}: no split {', '.join(missing)} (its splits: {', '.join(sorted(splits))})")
    return sha


def open_split(spec: HubDataset, sha: str) -> Any:
    """The split (``datasets.Dataset``) at commit ``sha``: downloaded and prepared into the datasets cache once,
    reused from it after (offline: from it only)."""
    import datasets

    if hub_offline():
        return _cache_builder(spec, sha, _cached_config(spec, sha)).as_dataset(split=spec.split)
    return datasets.load_dataset(spec.repo_id, name=spec.config, split=spec.split, revision=sha)


# ---------------------------------------------------------------------------------------------- online
def _hub_sha(spec: HubDataset, where: str) -> str:
    from huggingface_hub import HfApi

    try:
        sha = HfApi().dataset_info(spec.repo_id, revision=spec.revision).sha
    except Exception as err:  # noqa: BLE001 (mapped to one line, or raised as it is)
        raise _hub_error(err, spec, where) from None
    _remember_ref(spec, sha)
    return sha


def _remember_ref(spec: HubDataset, sha: str) -> None:
    """Record branch/tag -> sha in huggingface_hub's cache (``refs/<revision>``, the file hf_hub_download writes):
    the data is then loaded at the sha, which writes no ref, and HF_HUB_OFFLINE reads this one."""
    from huggingface_hub import constants

    if spec.revision == sha:
        return
    ref = (
        Path(constants.HF_HUB_CACHE) / f"datasets--{spec.repo_id.replace('/', '--')}" / "refs" / spec.revision
    )
    ref.parent.mkdir(parents=True, exist_ok=True)
    if not ref.is_file() or ref.read_text() != sha:
        ref.write_text(sha)


def _hub_error(err: Exception, spec: HubDataset, where: str) -> Exception:
    """One line for what the Hub answered; an unknown failure is returned unchanged."""
    import httpx
    from datasets.exceptions import DatasetNotFoundError
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    token = hub_token() is not None
    if isinstance(err, GatedRepoError) or isinstance(err, DatasetNotFoundError) and "gated" in str(err):
        how = "your token has no access yet" if token else f"no token is set ({_LOGIN})"
        return DataError(f"{where}: the dataset is gated on the Hub and {how}: ask for access on its page")
    if isinstance(err, RevisionNotFoundError):
        return DataError(f"{where}: the dataset has no revision {spec.revision} on the Hub")
    if isinstance(err, RepositoryNotFoundError | DatasetNotFoundError):
        why = (
            "or your token cannot read it"
            if token
            else f"or it is private or gated and no token is set ({_LOGIN})"
        )
        return DataError(f"{where}: no such dataset on the Hub ({constants.ENDPOINT}), {why}")
    if isinstance(err, httpx.HTTPError | OSError):
        return DataError(
            f"{where}: the Hub ({constants.ENDPOINT}) cannot be reached ({type(err).__name__}); a dataset loaded "
            "before is read from the cache with HF_HUB_OFFLINE=1"
        )
    return err


def _hub_splits(spec: HubDataset, sha: str, where: str) -> tuple[list[str], str | None]:
    """(split names of the config, one data file of the first split named) from the dataset's card and listing."""
    import datasets

    try:
        builder = datasets.load_dataset_builder(spec.repo_id, name=spec.config, revision=sha)
    except ValueError as err:  # an unknown config, or none named where several exist: datasets lists them
        raise DataError(f"{where}: {str(err).strip().splitlines()[0]}") from None
    except Exception as err:  # noqa: BLE001
        cause = err.__cause__ if isinstance(err.__cause__, Exception) else err
        raise _hub_error(cause, spec, where) from None
    files = builder.config.data_files or {}
    splits = [str(name) for name in files] or [str(name) for name in builder.info.splits or {}]
    first = spec.split_names[0]
    return splits, (files[first][0] if files.get(first) else None)


def _check_access(spec: HubDataset, data_file: str | None, where: str) -> None:
    """One HEAD of a data file: a gated dataset lists its files to anyone but serves them only to granted tokens."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    prefix = f"hf://datasets/{spec.repo_id}@"
    if data_file is None or not data_file.startswith(prefix):
        return
    sha, _, path = data_file[len(prefix) :].partition("/")
    try:
        get_hf_file_metadata(hf_hub_url(spec.repo_id, path, repo_type="dataset", revision=sha))
    except Exception as err:  # noqa: BLE001
        raise _hub_error(err, spec, where) from None


# ---------------------------------------------------------------------------------------------- offline
def _cached_sha(spec: HubDataset) -> str | None:
    """The commit a revision names in the caches: a sha as given; a branch or tag by huggingface_hub's refs."""
    import datasets
    from huggingface_hub import constants

    if SHA.fullmatch(spec.revision):
        return spec.revision
    repo = Path(constants.HF_HUB_CACHE) / f"datasets--{spec.repo_id.replace('/', '--')}"
    try:
        sha = (repo / "refs" / spec.revision).read_text().strip()
    except OSError:
        return None
    return sha if any(_cache_root(spec, datasets.config.HF_DATASETS_CACHE).glob(f"*/*/{sha}")) else None


def _cache_root(spec: HubDataset, cache: Any) -> Path:
    from datasets.naming import camelcase_to_snakecase

    owner, name = spec.repo_id.split("/")
    return Path(cache).expanduser() / f"{owner}___{camelcase_to_snakecase(name)}"


def _cached_config(spec: HubDataset, sha: str) -> str:
    """The config's directory name in the datasets cache for ``sha``: the one named, or the only one cached."""
    import datasets

    found = sorted(
        p.parts[-3] for p in _cache_root(spec, datasets.config.HF_DATASETS_CACHE).glob(f"*/*/{sha}")
    )
    if spec.config is not None:
        return spec.config if spec.config in found else ""
    return found[0] if len(found) == 1 else ("default" if "default" in found else "")


def _cache_builder(spec: HubDataset, sha: str, config: str) -> Any:
    from datasets.packaged_modules.cache.cache import Cache

    return Cache(repo_id=spec.repo_id, dataset_name=spec.repo_id.split("/")[-1], config_name=config, hash=sha)


def _cached_splits(spec: HubDataset, sha: str, where: str) -> list[str]:
    config = _cached_config(spec, sha)
    if not config:
        named = f"config {spec.config}" if spec.config else "one config (name it: config=...)"
        raise DataError(
            f"{where}: {named} of commit {sha[:12]} is not in the datasets cache and HF_HUB_OFFLINE is set"
        )
    return [str(name) for name in _cache_builder(spec, sha, config).info.splits or {}]
