"""Hub datasets under HF_HUB_OFFLINE, read from huggingface_hub's cache as ``hf download --repo-type dataset
OWNER/NAME`` fills it (``HF_HOME/hub/datasets--OWNER--NAME``: ``refs/<branch>``, ``snapshots/<sha>/`` linking
into ``blobs/``), or as an online run left it.

huggingface_hub resolves the revision to its snapshot and, where ``hf download`` cached the commit's file
listing, says whether every file the entry reads is there; ``datasets`` then reads the snapshot folder as it
reads the repo online (the README's configs and their data_files, ``data_files=``, or the file layout), preparing
it into its own cache (HF_DATASETS_CACHE) on first use. Nothing here makes a request.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from coati_kto.config.hub import HubDataset, offline_name
from coati_kto.errors import DataError

README = "README.md"


def fill_command(spec: HubDataset, revision: str | None = None) -> str:
    """The ``hf download`` command that puts the dataset at ``revision`` (default: the entry's) into the cache."""
    revision = revision or spec.revision
    pin = "" if revision == "main" else f" --revision {revision}"
    return f"hf download --repo-type dataset {spec.repo_id}{pin}"


def cached_snapshot(spec: HubDataset, revision: str, where: str) -> Path:
    """The cached snapshot folder (named by its commit sha) of ``revision``, holding every file the entry reads.
    Raises DataError (one line) when the cache lacks the dataset, the revision, or one of those files."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    def local(patterns: list[str] | None) -> Path:
        found = snapshot_download(
            spec.repo_id,
            repo_type="dataset",
            revision=revision,
            local_files_only=True,
            allow_patterns=patterns,
        )
        return Path(found)

    patterns: list[str] | None = [README]
    try:
        # The card first: its configs say which files a named config reads (None: the whole snapshot).
        patterns = _read_patterns(spec, local(patterns) / README)
        return local(patterns)
    except IncompleteSnapshotError as err:
        raise DataError(_incomplete(spec, Path(err.snapshot_path), patterns, revision, where)) from None
    except LocalEntryNotFoundError:
        raise DataError(_not_cached(spec, revision, where)) from None


def cached_splits(spec: HubDataset, folder: Path, where: str) -> list[str]:
    """The split names the entry's config has in the snapshot ``folder``, as ``datasets`` reads it."""
    builder = _builder(spec, folder, where)
    files = builder.config.data_files or {}
    return [str(name) for name in files] or [str(name) for name in builder.info.splits or {}]


def load_cached(spec: HubDataset, folder: Path) -> Any:
    """The split (``datasets.Dataset``) read from the snapshot ``folder``."""
    import datasets

    return datasets.load_dataset(str(folder), name=spec.config, data_files=spec.data_files, split=spec.split)


def _builder(spec: HubDataset, folder: Path, where: str) -> Any:
    import datasets
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    try:
        return datasets.load_dataset_builder(str(folder), name=spec.config, data_files=spec.data_files)
    except ValueError as err:
        raise DataError(f"{where}: {config_problem(err)}") from None
    except FileNotFoundError:  # a pattern that matches no file, or no data file at all
        pass
    what = f"matches data_files={spec.data_files}" if spec.data_files else "is a data file datasets reads"
    try:  # the listing `hf download` cached: the snapshot holds every file the entry reads (checked before)
        get_cached_repo_tree(spec.repo_id, repo_type="dataset", revision=folder.name)
    except CachedRepoTreeNotFoundError:
        raise DataError(
            f"{where}: no file of the cached snapshot {folder.name[:12]} ({folder}) {what} (a partial "
            f"download? `{fill_command(spec)}` completes it)"
        ) from None
    raise DataError(f"{where}: no file of the dataset at {folder.name[:12]} {what}")


def config_problem(err: ValueError) -> str:
    """datasets' message for an unknown config, or for none named where several exist, in one line."""
    lines = str(err).strip().splitlines()
    several = re.search(r"available configs: \[(.*)\]", str(err))
    if lines[0] == "Config name is missing." and several:
        return (
            f"the dataset has several configs ({several[1].replace(chr(39), '')}): name one with config=..."
        )
    return lines[0]


def _read_patterns(spec: HubDataset, card: Path) -> list[str] | None:
    """The repo files the entry reads, as globs (matched as huggingface_hub matches ``allow_patterns``, which
    takes in at least what ``datasets`` would); None for the whole snapshot (a layout ``datasets`` infers)."""
    if spec.data_files:
        return [README, spec.data_files]
    if not card.is_file():
        return None
    from datasets.data_files import sanitize_patterns
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCard

    try:
        configs = MetadataConfigs.from_dataset_card_data(DatasetCard.load(card).data)
        config = configs.get(spec.config or configs.get_default_config_name() or "", {})
        if config.get("data_dir"):
            return [README, f"{config['data_dir'].strip('/')}/*"]
        if config.get("data_files"):
            return [README, *(p for ps in sanitize_patterns(config["data_files"]).values() for p in ps)]
    except ValueError:  # a card datasets cannot read: it says so when it reads the snapshot
        return None
    return None


def _incomplete(spec: HubDataset, folder: Path, patterns: list[str] | None, revision: str, where: str) -> str:
    """The line for a snapshot that lacks files the entry reads (an interrupted or ``--include``d download)."""
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.utils import filter_repo_objects

    listed = get_cached_repo_tree(spec.repo_id, repo_type="dataset", revision=folder.name)
    absent = [f.path for f in listed if not (folder / f.path).exists()]
    missing = sorted(filter_repo_objects(absent, allow_patterns=patterns))
    shown = ", ".join(missing[:3]) + (f", ... ({len(missing)} in all)" if len(missing) > 3 else "")
    return (
        f"{where}: the cached snapshot {folder.name[:12]} of revision {revision} lacks files ({shown}) and "
        f"{offline_name()} is set: `{fill_command(spec, revision)}` completes it where "
        "the Hub can be reached"
    )


def _not_cached(spec: HubDataset, revision: str, where: str) -> str:
    """The line for a dataset, or a revision of it, that is not in the cache at all."""
    from huggingface_hub import constants

    held = cached_revisions(spec.repo_id)
    if held:
        what = f"revision {revision} is not in the Hugging Face cache ({constants.HF_HUB_CACHE} holds {held})"
    else:
        what = f"not in the Hugging Face cache ({constants.HF_HUB_CACHE})"
    return (
        f"{where}: {what} and {offline_name()} is set: fill it with "
        f"`{fill_command(spec, revision)}` where the "
        "Hub can be reached"
    )


def cached_revisions(repo_id: str) -> str:
    """The dataset's cached snapshots, each by its refs (branches, tags) or its sha: "main, 3f2a1b0c9d8e"."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        repos = scan_cache_dir().repos
    except CacheNotFound:
        return ""
    names = [
        ", ".join(sorted(rev.refs)) or rev.commit_hash[:12]
        for repo in repos
        if repo.repo_type == "dataset" and repo.repo_id == repo_id
        for rev in sorted(repo.revisions, key=lambda r: r.commit_hash)
    ]
    return ", ".join(names)
