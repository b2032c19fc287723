"""``output.push_to_hub``: upload a finished export (``final/``, or ``coati-kto export``'s directory) with its model
card to a Hub model repo, through huggingface_hub (create_repo, create_branch, upload_folder). Global rank 0 only.

The token is huggingface_hub's (HF_TOKEN, else the token file ``hf auth login`` wrote): it is never read into
the config, printed or written; a failure's one line is scrubbed of it all the same. A failed upload leaves
every file on disk and says how to retry (``coati-kto export CONFIG --push`` uploads ``final/`` again).
"""

from __future__ import annotations

from pathlib import Path

from coati_kto.config.hub import hub_token
from coati_kto.config.push import PushToHubSection
from coati_kto.config.schema import Config
from coati_kto.parallel.distributed import global_rank
from coati_kto.runtime.run_dir import FINAL_DIR

RETRY = "coati-kto export CONFIG --push"


def push_folder(folder: Path, push: PushToHubSection, what: str) -> tuple[bool, str]:
    """Upload ``folder`` (every file, as it is on disk) to ``push.repo_id`` on branch ``push.revision``, creating
    the repo (``push.private``) and the branch (from main) when missing. (uploaded, the one line to print)."""
    from huggingface_hub import HfApi, constants

    api = HfApi()
    where = f"{push.repo_id}" + (f" (branch {push.revision})" if push.revision != "main" else "")
    try:
        api.create_repo(push.repo_id, private=push.private, exist_ok=True)
        if push.revision != "main":
            api.create_branch(push.repo_id, branch=push.revision, exist_ok=True)
        commit = api.upload_folder(
            repo_id=push.repo_id,
            folder_path=folder,
            revision=push.revision,
            commit_message=f"coati-kto: {what}",
        )
    except Exception as err:  # noqa: BLE001 (any failure: the files stay, the line says how to retry)
        first = (str(err).strip().splitlines() or [""])[0][:300]
        token = hub_token()
        if token:
            first = first.replace(token, "***")
        return False, (
            f"output.push_to_hub: uploading {folder} to {where} on {constants.ENDPOINT} failed "
            f"({type(err).__name__}: {first}); everything is on disk: retry with `{RETRY}`"
        )
    return True, f"pushed {folder} to {where}: commit {commit.oid[:12]} ({commit.commit_url})"


def push_final(config: Config) -> bool | None:
    """The end of a run: global rank 0 uploads output.dir/final (None: no output.push_to_hub, or another rank).
    Called once the run is over (its peers gone, its heartbeat stopped): an upload may take hours."""
    push = config.training_output().push_to_hub
    if push is None or global_rank() != 0:
        return None
    uploaded, line = push_folder(
        Path(config.training_output().dir) / FINAL_DIR, push, "final/ at the end of the run"
    )
    print(line, flush=True)
    return uploaded
