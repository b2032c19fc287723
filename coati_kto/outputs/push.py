"""``output.push_to_hub``: upload a finished export (``final/``, or ``coati-kto export``'s directory) with its model
card to a Hub model repo, through huggingface_hub (create_repo, create_branch, upload_folder). Global rank 0 only.

The token is huggingface_hub's (HF_TOKEN, else the token file ``hf auth login`` wrote): it is never read into
the config, printed or written; a failure's one line is scrubbed of it all the same. A failed upload leaves
every file on disk and says how to retry (``coati-kto export CONFIG --push`` uploads ``final/`` again).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import queue
import threading
from concurrent.futures import Future
from pathlib import Path

from coati_kto.errors import without_secrets
from coati_kto.config.output import OutputSection
from coati_kto.config.push import PushToHubSection
from coati_kto.parallel.distributed import global_rank
from coati_kto.runtime.run_dir import FINAL_DIR

RETRY = "coati-kto export CONFIG --push"
ON_FAILURE = f"everything is on disk: retry with `{RETRY}`"


def push_folder(
    folder: Path,
    push: PushToHubSection,
    what: str,
    on_failure: str = ON_FAILURE,
    shown: Path | None = None,
    mirror: bool = False,
) -> tuple[bool, str]:
    """Upload ``folder`` (every file, as it is on disk) to ``push.repo_id`` on branch ``push.revision``, creating
    the repo (``push.private``) and the branch (from main) when missing; with ``mirror`` the branch's other files
    are deleted in the same commit (a checkpoint's branch: main's files, or a re-saved step's older shards, would
    download beside it as one checkpoint). (uploaded, the one line to print, which names ``shown`` or ``folder``
    and, on failure, ends with ``on_failure``)."""
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
            delete_patterns="*" if mirror else None,
        )
    except Exception as err:  # noqa: BLE001 (any failure: the files stay, the line says how to retry)
        first = (without_secrets(str(err)).strip().splitlines() or [""])[0][:300]  # scrubbed, then cut
        return False, (
            f"output.push_to_hub: uploading {shown or folder} to {where} on {constants.ENDPOINT} failed "
            f"({type(err).__name__}: {first}); {on_failure}"
        )
    return True, f"pushed {shown or folder} to {where}: commit {commit.oid[:12]} ({commit.commit_url})"


def upload(push: PushToHubSection, folder: Path, what: str) -> bool:
    """Upload ``folder`` to ``push`` and print the line saying how it went (one process): True when it went up."""
    uploaded, line = push_folder(folder, push, what)
    print(line, flush=True)
    return uploaded


def push_final(output: OutputSection) -> bool | None:
    """The end of a run: global rank 0 uploads output.dir/final (None: no output.push_to_hub, or another rank).
    Called once the run is over (its peers gone, its heartbeat stopped): an upload may take hours."""
    push = output.push_to_hub
    if push is None or global_rank() != 0:
        return None
    return upload(push, Path(output.dir) / FINAL_DIR, "final/ at the end of the run")


def pushed_at_end(final: bool | None, checkpoints_up: bool) -> bool | None:
    """Whether the run's uploads all went up (False: the run exits 3, PUSH_FAILED_EXIT_CODE): ``final``,
    :func:`push_final`'s answer (None: none pushed here), and ``checkpoints_up``, whether every checkpoint
    :class:`CheckpointUploads` took went up (each failure was said with its retry as it happened)."""
    if checkpoints_up:
        return final
    print(
        "output.push_to_hub.checkpoints: not every checkpoint went up (each failure is said above, with its "
        "retry): the run exits 3",
        flush=True,
    )
    return False


class CheckpointUploads:
    """Global rank 0, ``output.push_to_hub.checkpoints``: each complete checkpoint goes to its own branch (named as
    its directory, ``step-N``), one upload at a time on a background thread, so no step waits for the network
    (and no peer waits in a collective past train.dist_timeout). The checkpoint's files are hard-linked into
    ``staging/step-N`` first: ``output.keep_last`` may delete the checkpoint while it is uploading."""

    def __init__(self, push: PushToHubSection, staging: Path) -> None:
        self.push = push
        self.staging = staging
        self._uploads: list[tuple[str, Future]] = []
        # One daemon thread, fed in order: a run that ends with an error leaves without waiting for it (abandon)
        self._queue: queue.Queue[tuple[Path, Path, Future] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="hub-checkpoint-upload", daemon=True)
        self._thread.start()
        self._abandoned = False
        self._checkpoints: dict[str, Path] = {}  # by name, for the retry lines

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            staged, checkpoint, future = item
            if future.set_running_or_notify_cancel():  # False: cancelled by abandon()
                try:
                    future.set_result(self._upload(staged, checkpoint))
                except BaseException as err:  # noqa: BLE001 - the caller's result() raises it
                    future.set_exception(err)

    def __call__(self, checkpoint: Path) -> None:
        """Called by CheckpointManager once ``checkpoint`` is complete (its COMPLETE marker written)."""
        staged = self.staging / checkpoint.name
        shutil.rmtree(staged, ignore_errors=True)
        try:
            shutil.copytree(checkpoint, staged, copy_function=os.link)  # same filesystem: no bytes copied
        except OSError as err:  # no hard links there (gcsfuse, s3fs, CIFS) or another mount: skip, never stop
            shutil.rmtree(staged, ignore_errors=True)
            retry = f"hf upload {self.push.repo_id} {checkpoint} --revision {checkpoint.name}"
            # copytree gathers its files' errors in one shutil.Error: (source, target, why) each; the first says it
            cause = (
                err.args[0][0][2] if isinstance(err, shutil.Error) and err.args[0] else err.strerror or err
            )
            line = (
                f"checkpoint {checkpoint.name} not uploaded: cannot hard-link it into {self.staging} ({cause}); "
                f"the run goes on; to upload it while output.keep_last keeps it: `{retry}`"
            )
            print(line, flush=True)
            skipped: Future = Future()
            skipped.set_result((False, line))
            self._uploads.append((checkpoint.name, skipped))
            return
        upload: Future = Future()
        self._checkpoints[checkpoint.name] = checkpoint
        self._queue.put((staged, checkpoint, upload))
        self._uploads.append((checkpoint.name, upload))
        print(f"uploading checkpoint {checkpoint.name} to {self.push.repo_id} in the background", flush=True)

    def _upload(self, staged: Path, checkpoint: Path) -> tuple[bool, str]:
        branch = self.push.model_copy(update={"revision": checkpoint.name})
        retry = f"hf upload {self.push.repo_id} {checkpoint} --revision {checkpoint.name}"
        on_failure = f"the run goes on; to retry while output.keep_last keeps the checkpoint: `{retry}`"
        ok = False
        try:
            ok, line = push_folder(
                staged, branch, f"checkpoint {checkpoint.name}", on_failure, checkpoint, mirror=True
            )
            if not ok and not checkpoint.is_dir():  # pruned while it uploaded: the staged copy is all that is left
                retry = f"hf upload {self.push.repo_id} {staged} --revision {checkpoint.name}"
                line = line.replace(on_failure, f"the run goes on; it was pruned since, so its copy stays: `{retry}`")
            print(line, flush=True)
            return ok, line
        finally:
            if ok or checkpoint.is_dir():
                shutil.rmtree(staged, ignore_errors=True)

    def wait(self) -> bool:
        """The end of the run: waits for the uploads still running; True if all went up (False after
        :meth:`abandon`, at once)."""
        if self._abandoned:
            return False
        running = [name for name, upload in self._uploads if not upload.done()]
        if running:
            print(
                f"waiting for the upload of checkpoint {', '.join(running)} to {self.push.repo_id}",
                flush=True,
            )
        self._queue.put(None)
        self._thread.join()
        with contextlib.suppress(OSError):  # kept where it holds a pruned checkpoint that did not go up
            self.staging.rmdir()
        return all(upload.result()[0] for _, upload in self._uploads)

    def abandon(self) -> None:
        """The run ends with an error: its peers exit now, and a launcher ends a rank that outlives them (torchrun:
        SIGKILL 30 s on), so no upload is waited for. Each one not done is said with the command that uploads it;
        the one under way is cut off with the process (a Hub commit is whole or absent)."""
        self._abandoned = True
        for name, upload in self._uploads:
            if upload.done() or not (upload.cancel() or upload.running()):
                continue
            checkpoint = self._checkpoints[name]
            print(
                f"checkpoint {name} not uploaded: the run ended with an error; to upload it while "
                f"output.keep_last keeps it: `hf upload {self.push.repo_id} {checkpoint} --revision {name}`",
                flush=True,
            )


def checkpoint_uploads(output: OutputSection) -> CheckpointUploads | None:
    """The uploader for ``output.push_to_hub.checkpoints`` on global rank 0 (None elsewhere, or when off)."""
    push = output.push_to_hub
    if push is None or not push.checkpoints or global_rank() != 0:
        return None
    return CheckpointUploads(push, Path(output.dir) / ".hub_uploads")
