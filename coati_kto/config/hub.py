"""Hub ids and local paths: the one rule for telling a Hugging Face Hub id from a path in a config value."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# "name" or "org/name": letters, digits, "_", "." and "-", each part starting with a letter or digit.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
HUB_TIMEOUT_S = 10.0


def looks_like_hub_id(value: str) -> bool:
    """Whether ``value`` has the shape of a Hub id (whether or not it exists, locally or on the Hub)."""
    return HUB_ID.fullmatch(value) is not None


def hub_id(name: str | None) -> str | None:
    """``name`` when it reads as a Hub id and is no existing local path; else None."""
    if not name or Path(name).exists() or not looks_like_hub_id(name):
        return None
    return name


def looks_like_path(value: str) -> bool:
    """Whether a model source that does not exist was meant as a local path (not a hub id)."""
    return (
        value.startswith(("/", "./", "../", "~", "."))
        or value.count("/") > 1
        or value.endswith("/")
        or os.sep != "/"
        and os.sep in value
        or not looks_like_hub_id(value)
    )


def missing_path(key: str, value: str) -> str:
    """The line for a local model source that does not exist; a relative one names the directory it was read from."""
    where = "" if Path(value).expanduser().is_absolute() else f", read from {Path.cwd()}"
    return f"{key}: {value} does not exist (a local path{where}; a hub id looks like org/name)"


def anchored(value: Any, base: str | None) -> Any:
    """``value`` as the working directory ``base`` reads it: a relative local path joined to ``base`` (``~``
    expanded); an absolute one, a Hub dataset, anything not text, or no ``base``: as it is."""
    if not isinstance(value, str) or base is None or is_hub_dataset(value):
        return value
    path = Path(value).expanduser()
    return value if path.is_absolute() else str(Path(base) / path)


def same_path(old: Any, new: Any, old_base: str | None = None) -> bool:
    """Two config values that name one thing: one existing file or folder written two ways (a trailing slash,
    relative and absolute, ``~``, through a link), ``old`` read from the working directory ``old_base`` (None:
    this one); else equal values (a Hub id, a path gone since: nothing on disk tells them apart)."""
    if not (isinstance(old, str) and isinstance(new, str)):
        return old == new
    here, there = _saved_path(old, old_base), Path(new).expanduser()
    if here.exists() and there.exists():  # equal text from two directories may name two files
        return here.resolve() == there.resolve()
    return old == new


def same_folder(old: Any, new: Any, old_base: str | None = None) -> bool:
    """Two values of a model key that name one folder (:func:`same_path`, ``old`` read from ``old_base``). The
    weights' own digest is checked apart (reference)."""
    return same_path(old, new, old_base) and (old == new or _saved_path(old, old_base).is_dir())


def _saved_path(old: str, old_base: str | None) -> Path:
    """A saved path as its run's directory ``old_base`` reads it; read from here when nothing is there (the
    recorded directory gone: a job's scratch, another machine)."""
    here = Path(anchored(old, old_base)).expanduser()
    return here if here.exists() else Path(old).expanduser()


def local_snapshot(name_or_path: str | Path) -> Path | None:
    """The folder ``from_pretrained`` reads ``name_or_path`` from: itself when it is a folder, else a Hub id's
    snapshot in the hub cache (as it was downloaded: never fetched here), else None (an empty name too: not the
    working directory)."""
    if not str(name_or_path):
        return None
    local = Path(name_or_path)
    if local.is_dir():
        return local
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(name_or_path), local_files_only=True))
    except Exception:  # noqa: BLE001 - not a Hub id, or not in the cache: nothing on disk
        return None


def local_sibling_hint(repo_id: str) -> str:
    """For an ``org/name`` found nowhere whose ``org`` is a local folder (``outputs/tiny-chatt``): a clause naming
    the folder and its nearest subfolder, since the value was likely a mistyped path; else ''."""
    import difflib

    folder, name = Path(repo_id).parent, Path(repo_id).name
    if str(folder) == "." or not folder.is_dir():
        return ""
    subfolders = sorted(p.name for p in folder.iterdir() if p.is_dir())
    near = difflib.get_close_matches(name, subfolders, n=1)
    return f"; {folder}/ is a local folder without {name}" + (
        f" (did you mean {folder / near[0]}?)" if near else ""
    )


def hub_problems(key: str, repo_id: str) -> list[str]:
    """One look-up: the local hub cache first; then, unless HF_HUB_OFFLINE, one HEAD request, no retries. A line
    ends with :func:`local_sibling_hint`'s clause when ``repo_id`` reads as a mistyped local path too."""
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return []
    return [line + local_sibling_hint(repo_id) for line in _remote_problems(key, repo_id)]


def _remote_problems(key: str, repo_id: str) -> list[str]:
    from huggingface_hub import constants

    if variable := offline_variable():
        return [f"{key}: {repo_id} is not a local directory and not in the hub cache, and {variable} is set"]
    import httpx
    from huggingface_hub.utils import build_hf_headers, get_session

    url = f"{constants.ENDPOINT}/{repo_id}/resolve/main/config.json"
    try:  # huggingface_hub 1.x's session is an httpx.Client (requests' allow_redirects is a TypeError there)
        response = get_session().head(
            url, headers=build_hf_headers(), timeout=HUB_TIMEOUT_S, follow_redirects=True
        )
    except (httpx.HTTPError, OSError) as err:  # DNS, connection refused, timeout: the hub cannot be reached
        return [
            f"{key}: {repo_id} is not a local directory, and the hub ({constants.ENDPOINT}) cannot be reached "
            f"({type(err).__name__}): download the model and set {key} to its directory"
        ]
    if response.status_code in (401, 403):
        # Without a token the Hub answers a missing repo and a private one alike (401 RepoNotFound); a gated
        # repo's files say GatedRepo.
        if response.headers.get("X-Error-Code") == "RepoNotFound" and not hub_token():
            return [
                f"{key}: {repo_id} is neither a local directory nor a public model on the hub (check the id; a "
                "private repo needs a token: see docs/operations.md, Credentials)"
            ]
        return [
            f"{key}: {repo_id} on the hub needs a token (gated or private): see docs/operations.md, Credentials"
        ]
    if response.status_code == 404:
        return [f"{key}: {repo_id} is neither a local directory nor a model on the hub"]
    return []


TRUE_VALUES = {"1", "ON", "YES", "TRUE"}


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE), read now (huggingface_hub's constant is read once, at import)."""
    return offline_variable() is not None


def offline_variable() -> str | None:
    """The variable that puts the Hub offline, for a message to name what the user set: HF_HUB_OFFLINE, else
    TRANSFORMERS_OFFLINE (huggingface_hub reads it when HF_HUB_OFFLINE is unset or empty); None when online."""
    from huggingface_hub import constants

    name = "HF_HUB_OFFLINE" if os.environ.get("HF_HUB_OFFLINE") else "TRANSFORMERS_OFFLINE"
    if os.environ.get(name, "").upper() in TRUE_VALUES:
        return name
    # Set when huggingface_hub was imported and since removed from the environment: it stays offline.
    return "HF_HUB_OFFLINE" if constants.HF_HUB_OFFLINE else None


def offline_name() -> str:
    """The offline variable for a message said while offline: the one the user set (``offline_variable``), else
    HF_HUB_OFFLINE, the one to unset."""
    return offline_variable() or "HF_HUB_OFFLINE"


def hub_token() -> str | None:
    """The Hugging Face token (HF_TOKEN, else the token file ``hf auth login`` wrote): to pass on, never to show."""
    from huggingface_hub import get_token

    return get_token()


# ------------------------------------------------------------------------------------------ Hub datasets
DATASET_PREFIX = "hf://datasets/"
DATASET_KEYS = ("config", "data_files", "split", "revision")
# The split when none is named: TRL's defaults (--dataset_train_split train, --dataset_test_split test).
DEFAULT_SPLIT = {"data.train_files": "train", "data.eval_files": "test"}
# datasets' split syntax: names joined by "+", each optionally sliced ("train[:1000]", "train[10%:]").
SPLIT = re.compile(r"[\w.-]+(\[[^\]]*\])?(\+[\w.-]+(\[[^\]]*\])?)*")


@dataclass(frozen=True)
class HubDataset:
    """A Hub dataset in ``data.*_files``: ``load_dataset(repo_id, name=config, data_files=data_files, split=split,
    revision=revision)``; ``data_files`` is one path or glob inside the repo (its files form the split ``train``)."""

    repo_id: str
    config: str | None
    split: str
    revision: str
    data_files: str | None = None

    @property
    def source(self) -> str:
        """The entry as written back (every part explicit): what stats.json and the card name."""
        config = f"config={self.config}&" if self.config else ""
        files = f"data_files={self.data_files}&" if self.data_files else ""
        return f"{DATASET_PREFIX}{self.repo_id}?{config}{files}split={self.split}&revision={self.revision}"

    @property
    def split_names(self) -> list[str]:
        """The split names the split expression reads (``train[:10%]+test`` -> train, test)."""
        return [part.split("[")[0] for part in self.split.split("+")]


def is_hub_dataset(value: str) -> bool:
    return value.startswith(DATASET_PREFIX)


def parse_hub_dataset(value: str, key: str) -> HubDataset:
    """``hf://datasets/OWNER/NAME[?config=C][&data_files=F][&split=S][&revision=R]`` (values taken literally, not
    URL-decoded). Raises ValueError with the one line that says what is wrong."""
    repo_id, _, query = value[len(DATASET_PREFIX) :].partition("?")
    where = f"{key}: {value}"
    if "/" not in repo_id or not looks_like_hub_id(repo_id):
        raise ValueError(
            f"{where}: expected hf://datasets/OWNER/NAME, then ?config=...&data_files=...&split=...&revision=..."
        )
    options: dict[str, str] = {}
    for item in filter(None, query.split("&")):
        name, eq, text = item.partition("=")
        if name not in DATASET_KEYS or not eq or not text or name in options:
            hint = " (the config is config=, as TRL's --dataset_config)" if name == "name" else ""
            raise ValueError(
                f"{where}: {item!r} is not one of {', '.join(k + '=...' for k in DATASET_KEYS)}{hint}"
            )
        options[name] = text
    # data_files' files are datasets' split "train" (in eval files too), so that is the default split there.
    split = options.get("split", "train" if "data_files" in options else DEFAULT_SPLIT.get(key, "train"))
    if not SPLIT.fullmatch(split):
        raise ValueError(
            f"{where}: split {split!r} is no split expression (e.g. train, train[:1000], train+test)"
        )
    revision = options.get("revision", "main")
    return HubDataset(repo_id, options.get("config"), split, revision, options.get("data_files"))
