"""Waits on one rank's file work outlast ``train.dist_timeout`` (``coati_kto.parallel.store_waits``): they go
through the store, bounded by ``train.file_wait_timeout``. Before, they were collectives: a rank 0 writing
``final/`` for longer than ``train.dist_timeout`` failed the run at its very end (and on NCCL the watchdog
aborted it)."""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
import yaml
from helpers import preference_records

from coati_kto.data.files import write_jsonl
from coati_kto.testing.cli import run_cli
from coati_kto.testing.distributed import run_distributed

SHORT_S, SLOW_S = 1.0, 2.5  # the collectives' timeout here, and rank 0's file work: well past it


def _waits_outlast_the_group_timeout() -> dict:
    """Every rank: the default group's timeout cut to SHORT_S, then rank 0 works SLOW_S alone before each wait."""
    from coati_kto.parallel import store_waits
    from coati_kto.parallel.distributed import on_rank0, peer_failure

    rank, out = dist.get_rank(), {}
    pg_c10d = dist.distributed_c10d
    pg_c10d._set_pg_timeout(timedelta(seconds=SHORT_S))
    try:
        # The timeout is in force: a collective that waits SLOW_S for rank 0 fails (a group of its own: a
        # timed-out gloo group is not used again).
        short = dist.new_group(backend="gloo", timeout=timedelta(seconds=SHORT_S))
        if rank == 0:
            time.sleep(SLOW_S)
        try:
            dist.barrier(group=short)
            out["collective"] = "passed"
        except RuntimeError as err:
            out["collective"] = "timed out" if "timed out" in str(err).lower() else str(err)
        time.sleep(SLOW_S)  # rank 0's barrier timed out too: both are past it before the waits below

        # A signal that arrives while a rank waits is handled then (a stop, a second Ctrl-C's abort), not once
        # rank 0 is done: the wait polls the store from Python.
        handled: list[float] = []
        previous = signal.signal(signal.SIGUSR2, lambda *_: handled.append(time.monotonic()))
        if rank == 1:
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR2)).start()
        out["on_rank0"] = on_rank0(lambda: time.sleep(SLOW_S) or {"digest": "abc"}, "prepare the data")
        out["handled_while_waiting"] = bool(handled) and time.monotonic() - handled[0] > SLOW_S / 2
        signal.signal(signal.SIGUSR2, previous)
        if rank == 0:
            time.sleep(SLOW_S)
        store_waits.wait_for_all("global rank 0 to write final/")
        out["after_barrier"] = True
        if rank == 0:
            time.sleep(SLOW_S)
        out["no_failure"] = store_waits.first_failure(None, "write step-4.tmp")
        failure = "No space left on device: /ckpt/step-8.tmp/model" if rank == 1 else None
        out["failure"] = store_waits.first_failure(failure, "write step-8.tmp")

        # Past train.file_wait_timeout: one line that names the setting and what it waited for.
        store_waits.set_timeout(SHORT_S)
        try:
            on_rank0(lambda: time.sleep(SLOW_S), "prepare the data")
            out["timeout"] = None
        except store_waits.FileWaitTimeoutError as err:
            out["timeout"] = peer_failure(err)
        store_waits.set_timeout(60)
        store_waits.wait_for_all("both ranks to line up again")  # the counts of both ranks still agree
        out["in_step"] = True
    finally:
        store_waits.set_timeout(store_waits.DEFAULT_TIMEOUT_S)
        pg_c10d._set_pg_timeout(timedelta(seconds=120))  # the pool's (run_distributed)
    return out


def test_waits_for_file_work_outlast_the_collective_timeout() -> None:
    rank0, rank1 = run_distributed(_waits_outlast_the_group_timeout, 2)
    assert rank1["collective"] == "timed out"  # what every wait below was before
    for out in (rank0, rank1):
        assert out["on_rank0"] == {"digest": "abc"}
        assert out["after_barrier"] and out["in_step"]
        assert out["no_failure"] is None
        assert out["failure"] == (1, "No space left on device: /ckpt/step-8.tmp/model")
    assert rank1["handled_while_waiting"]
    # Rank 1 gave up waiting for rank 0's work; rank 0 then for rank 1 to read its answer.
    line = (
        "waited 1 s (train.file_wait_timeout) for {}; a rank is stuck or a node is gone: its own error, if any, "
        "is in its log; resume with train.resume=auto"
    )
    assert rank1["timeout"] == line.format("global rank 0 to prepare the data")
    assert rank0["timeout"] == line.format("the other ranks to read the store")


def _a_failed_rank_ends_the_waits() -> dict:
    """Rank 0 fails (it tells the store) instead of doing the work rank 1 waits for: rank 1 stops at once."""
    from coati_kto.parallel import store_waits

    rank, out = dist.get_rank(), {}
    started = time.monotonic()
    if rank == 0:
        time.sleep(0.5)
        store_waits.tell_peers("OSError: No space left on device: final.tmp/model.safetensors")
        store_waits.tell_peers("a later failure")  # the first is kept
        time.sleep(
            2.0
        )  # rank 1 reads the failure (polls are at most MAX_PAUSE_S apart) before rank 0 arrives
    try:
        store_waits.wait_for_all("global rank 0 to write final/")  # rank 0 too: it sees its own failure
        out["error"] = None
    except store_waits.PeerFailedError as err:
        out["error"], out["seconds"] = str(err), time.monotonic() - started
    dist.barrier()
    if rank == 0:  # the pool's store outlives this test
        dist.distributed_c10d._get_default_store().delete_key(store_waits.failure_key())
    dist.barrier()
    return out


def test_a_rank_that_fails_ends_the_others_waits_at_once() -> None:
    rank0, rank1 = run_distributed(_a_failed_rank_ends_the_waits, 2)
    assert rank1["error"] == (
        "rank 0: OSError: No space left on device: final.tmp/model.safetensors (this rank was waiting for "
        "global rank 0 to write final/); resume with train.resume=auto"
    )
    assert (
        rank1["seconds"] < 2.0
    )  # at its next poll: not train.heartbeat_timeout, nor train.file_wait_timeout
    assert rank0["error"].startswith("rank 0: OSError: No space left on device")  # (here rank 0 waited too)


def _a_later_command_starts_clean() -> dict:
    """Two commands on one process group, as the CLI's on a worker rank or in library use: in the first, rank 0
    fails and tells the store, leaving without the wait rank 1 entered (their counts of waits now differ). The
    second command's waits must neither read that failure nor wait on keys the other rank never writes."""
    from coati_kto.parallel import store_waits
    from coati_kto.parallel.distributed import init_distributed

    rank, out = dist.get_rank(), {}
    try:
        init_distributed(
            120, file_wait_timeout_s=10.0
        )  # the first command (the group exists: its waits begin)
        if rank == 0:
            store_waits.tell_peers("ValueError: the first command failed")
        else:
            try:
                store_waits.wait_for_all("global rank 0 to write final/")
            except store_waits.PeerFailedError as err:
                out["first"] = str(err)
        dist.barrier()
        init_distributed(120, file_wait_timeout_s=10.0)  # the next command
        out["second"] = store_waits.from_rank0("digest" if rank == 0 else None, "prepare the data")
        store_waits.wait_for_all("global rank 0 to write final/")
    finally:
        store_waits.set_timeout(store_waits.DEFAULT_TIMEOUT_S)
    return out


def test_the_next_command_on_the_same_group_starts_clean() -> None:
    rank0, rank1 = run_distributed(_a_later_command_starts_clean, 2)
    assert rank1["first"].startswith(
        "rank 0: ValueError: the first command failed (this rank was waiting for"
    )
    assert rank0["second"] == rank1["second"] == "digest"


def _config(model_dir: Path, root: Path, **train: object) -> Path:
    """``root/config.yaml``: a few steps of the tiny model on 16 records, ddp fp32, no epoch-end evaluation."""
    config = {
        "model": {"path": str(model_dir)},
        "data": {
            "train_files": [str(write_jsonl(preference_records(16, 0), root / "train.jsonl"))],
            "prepared_dir": str(root / "prepared"),
            "max_length": 24,
        },
        "train": {"micro_batch_size": 2, "eval_at_epoch_end": False, **train},
        "plugin": {"name": "ddp", "precision": "fp32"},
        "output": {"dir": str(root / "out")},
    }
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


SLOW_FINAL_S = 8.0  # rank 0's final/ write, past the run's train.dist_timeout


def _train_with_a_slow_final_write(argv: list[str]) -> int:
    """``coati-kto train`` whose global rank 0 takes SLOW_FINAL_S longer to write final/ (a slow filesystem)."""
    import coati_kto.recipe.train as recipe
    from coati_kto.cli import main

    write = recipe.save_final

    def slow(*args, **kwargs):
        result = write(*args, **kwargs)
        if os.environ["RANK"] == "0":
            time.sleep(SLOW_FINAL_S)
        return result

    recipe.save_final = slow  # put back by the pool's reset
    return main(argv)


def test_a_final_write_longer_than_dist_timeout_ends_the_run_cleanly(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    path = _config(tiny_model_dir, tmp_path, max_steps=2, dist_timeout=4.0)
    proc = run_cli(["train", str(path)], 2, merge_stderr=True, command=_train_with_a_slow_final_write)
    for rank in proc.ranks:
        assert rank.returncode == 0, rank.stdout[-3000:]
    assert (tmp_path / "out" / "final" / "model.safetensors").is_file()


def _train_with_a_failing_final_write(argv: list[str]) -> int:
    """``coati-kto train`` whose global rank 0 fails to write final/ (a full disk) after the export's own checks."""
    import coati_kto.recipe.train as recipe
    from coati_kto.cli import main

    write = recipe.save_final

    def failing(*args, **kwargs):
        write(*args, **kwargs)
        if os.environ["RANK"] == "0":
            raise OSError(28, "No space left on device", "final/README.md")

    recipe.save_final = failing  # put back by the pool's reset
    return main(argv)


def test_a_rank_0_failing_after_its_peers_finished_tells_them_why(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Its peers wait for rank 0 in the store (not a collective, whose closed sockets would end them): they stop
    at once with rank 0's one line, exit 1, instead of waiting for the heartbeat."""
    path = _config(tiny_model_dir, tmp_path, max_steps=1, eval_at_start=False)
    started = time.monotonic()
    proc = run_cli(["train", str(path)], 2, command=_train_with_a_failing_final_write, timeout_s=120)
    rank0, rank1 = proc.ranks
    assert rank0.returncode == 1 and "OSError: [Errno 28] No space left on device" in rank0.stderr
    assert rank1.returncode == 1
    assert rank1.stderr.strip().splitlines()[-1] == (
        "[rank 1] error: rank 0: OSError: [Errno 28] No space left on device: 'final/README.md' (its traceback is "
        "in its log) (this rank was waiting for global rank 0 to write final/); resume with train.resume=auto"
    )
    assert time.monotonic() - started < 60


def test_a_world_of_one_waits_for_nothing() -> None:
    """No process group, or one rank: the waits return at once, without a store."""
    from coati_kto.parallel import store_waits

    assert not dist.is_initialized()
    store_waits.wait_for_all("global rank 0 to write final/")
    assert store_waits.from_rank0({"a": 1}, "x") == {"a": 1}
    assert store_waits.first_failure(None, "x") is None
    assert store_waits.first_failure("disk full", "x") == (0, "disk full")


def _a_command_that_fails_on_rank_0() -> None:
    from coati_kto.parallel import store_waits
    from coati_kto.parallel.distributed import init_distributed

    init_distributed(120)
    if dist.get_rank() == 0:
        store_waits.tell_peers("ValueError: a pooled call failed")
    dist.barrier()


def _a_command_that_waits() -> str:
    from coati_kto.parallel import store_waits
    from coati_kto.parallel.distributed import init_distributed

    init_distributed(120)
    store_waits.wait_for_all("both ranks")
    return store_waits.from_rank0("fresh" if dist.get_rank() == 0 else None, "read a value")


def test_commands_in_separate_pooled_calls_never_share_keys() -> None:
    """The worker ranks put back module attributes a call rebinds: the counts are mutated in place, so a later
    call's command does not reuse an earlier one's keys (its failure, its stale values)."""
    run_distributed(_a_command_that_fails_on_rank_0, 2)
    assert run_distributed(_a_command_that_waits, 2) == ["fresh", "fresh"]


def _stop_with_uploads_running(upload_s: float) -> dict:
    """Every rank: a stop's aftermath with output.push_to_hub.checkpoints, global rank 0's uploads taking
    ``upload_s``; when each rank was done with it (its exit 75), and when rank 0's uploads were."""
    from coati_kto.config.output import OutputSection
    from coati_kto.recipe.train import wait_for_uploads_after_stop

    output = OutputSection(dir="out", push_to_hub={"repo_id": "org/model", "checkpoints": True})
    done: dict[str, float] = {}

    class Uploads:  # global rank 0's CheckpointUploads, its last upload still running
        def wait(self) -> bool:
            time.sleep(upload_s)
            done["uploads"] = time.monotonic()
            return True

    wait_for_uploads_after_stop(output, Uploads() if dist.get_rank() == 0 else None)
    done["left"] = time.monotonic()
    return done


def test_after_a_stop_no_rank_leaves_before_rank_0s_uploads_are_done() -> None:
    """torchrun ends the other workers once one exits non-zero, and SIGKILLs one that outlives that by 30 s: the
    ranks that exited 75 at once got rank 0 killed in the middle of the stop checkpoint's upload (the job exited
    1, so SLURM did not requeue it). Now every rank leaves after rank 0's uploads (the same machine's clock)."""
    rank0, rank1 = run_distributed(_stop_with_uploads_running, 2, SLOW_S)
    assert rank1["left"] >= rank0["uploads"] and rank0["left"] >= rank0["uploads"]
