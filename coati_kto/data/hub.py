"""Feedback data from the Hugging Face Hub: the ``hf://datasets/OWNER/NAME?config=C&split=S&revision=R`` entries
of ``data.train_files`` / ``data.eval_files`` (syntax: :mod:`coati_kto.config.hub`), read through ``datasets``.

:func:`check` resolves the revision to its commit sha and checks the dataset, config, split and access before
anything is downloaded (one line each: preflight and the prepared data's fingerprint call it); :func:`open_split`
then loads exactly that commit. Online, both ask the Hub (one repo-info request, the card and file listing, one
HEAD of a data file). Under HF_HUB_OFFLINE they read huggingface_hub's cache only, as ``hf download --repo-type
dataset`` or an online run filled it (:mod:`coati_kto.data.hub_cache`).
A token is passed on by huggingface_hub (HF_TOKEN or the token file); messages say whether one is set, never it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from coati_kto.config.hub import HubDataset, hub_offline, hub_token
from coati_kto.data.hub_cache import (
    cached_snapshot,
    cached_splits,
    config_problem,
    fill_command,
    load_cached,
)
from coati_kto.errors import DataError

_LOGIN = "HF_TOKEN, or `hf auth login`"


def pinned(spec: HubDataset, sha: str) -> str:
    """The entry with its revision replaced by the commit it resolved to (what stats.json and the card name)."""
    return replace(spec, revision=sha).source


def check(spec: HubDataset, key: str) -> str:
    """The commit sha ``spec.revision`` names, once the dataset, its config and split exist and are readable.
    Raises DataError (one line) otherwise. Downloads no data (the card and listings only)."""
    where = f"{key}: {spec.source}"
    if hub_offline():
        folder = cached_snapshot(spec, spec.revision, where)
        sha, splits = folder.name, cached_splits(spec, folder, where)
    else:
        sha, files = _hub_sha(spec, where)
        _match_data_files(spec, sha, files, where)
        splits, first_file = _hub_splits(spec, sha, where)
        _check_access(spec, first_file, where)
    missing = [name for name in spec.split_names if name not in splits]
    if missing:
        raise DataError(f"{where}: no split {', '.join(missing)} (its splits: {', '.join(sorted(splits))})")
    return sha


def open_split(spec: HubDataset, sha: str) -> Any:
    """The split (``datasets.Dataset``) at commit ``sha``: downloaded and prepared into the datasets cache once,
    reused from it after; offline, read from the hub cache's snapshot of ``sha``."""
    import datasets
    from datasets.exceptions import DatasetGenerationError

    try:
        if hub_offline():
            return load_cached(spec, cached_snapshot(spec, sha, spec.source))
        return datasets.load_dataset(
            spec.repo_id, name=spec.config, data_files=spec.data_files, split=spec.split, revision=sha
        )
    except DatasetGenerationError as err:  # a file that does not parse, shards of two schemas
        cause = err.__cause__ or err.__context__ or err
        # A CastError's reason is its last line, after the two schemas.
        lines = str(cause).strip().splitlines() or [""]
        first = f"{lines[0]} {lines[-1]}" if lines[-1].startswith("because") else lines[0][:240]
        raise DataError(
            f"{spec.source}: datasets cannot build the dataset at {sha[:12]} ({type(cause).__name__}: {first}); "
            "data.on_bad_record cannot skip inside a Hub dataset: fix its files, or read those that build "
            "(?data_files=...)"
        ) from None


# ---------------------------------------------------------------------------------------------- online
def _hub_sha(spec: HubDataset, where: str) -> tuple[str, list[str]]:
    """(the commit sha the revision names, the repo's file names at it), from one repo-info request."""
    from huggingface_hub import HfApi

    try:
        info = HfApi().dataset_info(spec.repo_id, revision=spec.revision)
    except Exception as err:  # noqa: BLE001 (mapped to one line, or raised as it is)
        raise _hub_error(err, spec, where) from None
    _remember_ref(spec, info.sha)
    return info.sha, [s.rfilename for s in info.siblings or []]


def _match_data_files(spec: HubDataset, sha: str, files: list[str], where: str) -> None:
    """Refuse a ``data_files`` glob that matches no file of the repo. (fnmatch's ``*`` also crosses "/", so
    whatever ``datasets`` would match is matched here: nothing is refused that ``datasets`` would read.)"""
    from huggingface_hub.utils import filter_repo_objects

    if spec.data_files and not list(filter_repo_objects(files, allow_patterns=[spec.data_files])):
        raise DataError(f"{where}: no file of the dataset at {sha[:12]} matches data_files={spec.data_files}")


def _remember_ref(spec: HubDataset, sha: str) -> None:
    """Record branch/tag -> sha in huggingface_hub's cache (``refs/<revision>``, the file hf_hub_download writes):
    the data is then loaded at the sha, which writes no ref, and HF_HUB_OFFLINE reads this one."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    if spec.revision == sha:
        return
    repo = repo_folder_name(repo_id=spec.repo_id, repo_type="dataset")
    ref = Path(constants.HF_HUB_CACHE) / repo / "refs" / spec.revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    if not ref.is_file() or ref.read_text() != sha:
        ref.write_text(sha)


def _hub_error(err: Exception, spec: HubDataset, where: str) -> Exception:
    """One line for what the Hub answered; an unknown failure is returned unchanged."""
    import httpx
    from datasets.data_files import EmptyDatasetError
    from datasets.exceptions import DataFilesNotFoundError, DatasetNotFoundError
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
    if isinstance(err, DataFilesNotFoundError | EmptyDatasetError):  # it answered: no file datasets reads
        what = f"matches data_files={spec.data_files}" if spec.data_files else "is a data file datasets reads"
        return DataError(f"{where}: no file of the dataset on the Hub {what} ({type(err).__name__})")
    if isinstance(err, httpx.HTTPError | OSError):
        return DataError(
            f"{where}: the Hub ({constants.ENDPOINT}) cannot be reached ({type(err).__name__}){_cached(spec)}"
        )
    return err


def _cached(spec: HubDataset) -> str:
    """What the cache offers when the Hub cannot be reached: the way to read it offline, or to fill it."""
    try:
        cached_snapshot(spec, spec.revision, spec.source)
    except DataError:
        return (
            f" and the Hugging Face cache holds no copy of it: fill the cache with `{fill_command(spec)}` where "
            "the Hub can be reached, then set HF_HUB_OFFLINE=1"
        )
    return "; the Hugging Face cache holds it: set HF_HUB_OFFLINE=1 to read it from there"


def _hub_splits(spec: HubDataset, sha: str, where: str) -> tuple[list[str], str | None]:
    """(split names of the config, one data file of the first split named) from the dataset's card and listing."""
    import datasets

    try:
        builder = datasets.load_dataset_builder(
            spec.repo_id, name=spec.config, data_files=spec.data_files, revision=sha
        )
    except ValueError as err:  # an unknown config, or none named where several exist: datasets lists them
        raise DataError(f"{where}: {config_problem(err)}") from None
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
