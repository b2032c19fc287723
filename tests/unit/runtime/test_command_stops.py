"""precompute and export have no step to finish: a stop signal ends them at once (``STOP.quit_on_stop``), with
their own cleanup run, a commit in progress completed, one line and exit 128 + the signal
(coati_kto.runtime.signals). Before, a forwarded SIGTERM killed their ranks with the default action (the launch:
"rank 0 failed with signal SIGTERM", exit 1, an export's scratch data left behind) and export's build turned a
stop into train's flag, which nothing read: it said "stopping after the current optimizer step" and went on.

Each probe is a real process (signals), importing only coati_kto.runtime (no torch)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from coati_kto.launch.torchrun import _failure_lines

_HEAD = """
import os, signal, sys, time
from pathlib import Path
from coati_kto.runtime import durable
from coati_kto.runtime.signals import STOP

root = Path(sys.argv[1])
target = root / "step-2"

def kill(signum):
    os.kill(os.getpid(), signum)
    time.sleep(0.2)  # the handler runs here (it raises, or the process ends)

STOP.quit_on_stop("export")
STOP.leaves(lambda: "complete" if (target / "card").is_file() else f"nothing written to {target.name}")
"""


def _probe(code: str, root: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    return subprocess.run(
        [sys.executable, "-c", _HEAD + code, str(root)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _ours(root: Path) -> list[str]:
    """Every entry under ``root`` named like a durable scratch or temporary directory."""
    return sorted(p.name for p in root.iterdir() if ".coati-kto-" in p.name)


_CLEANUP = """
def work():
    scratch = durable.own_dir(target, durable.DATA)
    try:
        kill(signal.SIGTERM)
        print("not reached", flush=True)
    finally:
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C as the cleanup runs: it must not cut it short
        time.sleep(0.2)
        import shutil
        shutil.rmtree(scratch)
        print("cleaned up", flush=True)

STOP.stoppable(work)
print("not reached either", flush=True)
"""


def test_a_stop_runs_the_commands_cleanup_then_exits_143_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "step-1").mkdir()  # an earlier export
    (tmp_path / "step-1" / "card").write_text("intact")
    done = _probe(_CLEANUP, tmp_path)
    assert done.returncode == 128 + signal.SIGTERM, done.stdout + done.stderr
    assert done.stdout == "cleaned up\n", done.stderr
    assert done.stderr == "export stopped by SIGTERM: nothing written to step-2\n"
    assert _ours(tmp_path) == [] and not (tmp_path / "step-2").exists()
    assert (tmp_path / "step-1" / "card").read_text() == "intact"


_COMMIT = """
replace = durable.replace_dir

def signalled_replace(new, to):
    os.kill(os.getpid(), signal.SIGTERM)  # as the renames start: they finish first
    time.sleep(0.2)
    replace(new, to)
    (to / "card").write_text("new")

durable.replace_dir = signalled_replace
STOP.stoppable(lambda: durable.write_dir(target, lambda d: (d / "weights").write_text("new")))
"""


def test_a_stop_during_a_commit_waits_for_its_renames(tmp_path: Path) -> None:
    """The old directory is renamed aside, then the new one in: a stop between the two would leave the old one
    aside and nothing in place. The stop waits for the renames, then ends the command, saying what is there."""
    (tmp_path / "step-2").mkdir()
    (tmp_path / "step-2" / "weights").write_text("old")
    done = _probe(_COMMIT, tmp_path)
    assert done.returncode == 128 + signal.SIGTERM, done.stdout + done.stderr
    assert done.stderr == "export stopped by SIGTERM: complete\n"
    assert (tmp_path / "step-2" / "weights").read_text() == "new"
    assert _ours(tmp_path) == []


_SWALLOWED = """
def work():
    try:
        kill(signal.SIGINT)
    except BaseException:  # a library's catch-all: the stop's exception is lost
        pass
    print("went on", flush=True)
    durable.write_dir(target, lambda d: (d / "weights").write_text("new"))
    print("committed", flush=True)

STOP.stoppable(work)
"""


def test_a_stop_whose_exception_a_library_swallowed_still_commits_nothing(tmp_path: Path) -> None:
    done = _probe(_SWALLOWED, tmp_path)
    assert done.returncode == 128 + signal.SIGINT, done.stdout + done.stderr
    assert done.stdout == "went on\n"
    assert done.stderr == "export stopped by SIGINT: nothing written to step-2\n"
    assert not (tmp_path / "step-2").exists() and _ours(tmp_path) == []


def test_a_stop_before_the_command_ends_it_at_once(tmp_path: Path) -> None:
    """Outside ``stoppable`` (imports, config; a rank's pending signal as it unblocks them) nothing of the
    command's is there to unwind: the handler ends the process, wherever the main thread is."""
    done = _probe('kill(signal.SIGTERM)\nkill(signal.SIGTERM)\nprint("not reached")', tmp_path)
    assert done.returncode == 128 + signal.SIGTERM, done.stdout + done.stderr
    assert (done.stdout, done.stderr) == ("", "export stopped by SIGTERM: nothing written to step-2\n")


_ENTRY = """
import os, signal, sys
from coati_kto.runtime.signals import STOP

STOP.block_for_launcher(sys.argv[1:])
if "RANK" in os.environ:
    STOP.start_rank(train=False)
print(signal.getsignal(signal.SIGTERM) == STOP._quit, flush=True)
"""


def test_precompute_and_export_get_the_quit_handlers_from_their_first_step() -> None:
    """A one-process precompute, export, prepare, inspect, plan or config from ``cli.entry``'s first step (its
    imports take seconds), a rank of a launched one from ``start_rank``; train keeps SIGTERM's default action
    until its own handlers (tests/unit/runtime/test_signals_at_start.py: its SIGUSR1 and Ctrl-C)."""

    def quits(argv: list[str], rank: bool) -> bool:
        env = {k: v for k, v in os.environ.items() if k != "RANK"} | ({"RANK": "1"} if rank else {})
        done = subprocess.run(
            [sys.executable, "-c", _ENTRY, *argv], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        return done.stdout == "True\n"

    assert quits(["precompute", "c.yaml"], rank=False)
    assert quits(["export", "c.yaml", "--out", "x"], rank=True)
    assert quits(["prepare", "c.yaml"], rank=False)  # it left its work folder behind before
    assert quits(["inspect", "c.yaml", "--ranks", "2"], rank=False)
    assert quits(["plan", "c.yaml"], rank=False)  # its Ctrl-C was lost in torch's import, SIGUSR1 killed it
    assert quits(["config", "c.yaml"], rank=False)
    assert not quits(["config", "c.yaml"], rank=True)
    assert not quits(["train", "c.yaml"], rank=False)


def test_the_launch_of_a_stopped_precompute_or_export_exits_128_plus_the_signal() -> None:
    """Its ranks exit 143 (130 for Ctrl-C) after a relayed stop; torchrun SIGTERMs any still exiting. The
    launcher says nothing more (rank 0 said what was left) and exits the same; it was "rank N failed", exit 1."""

    def failed(*codes: int) -> SimpleNamespace:
        failures = {
            r: SimpleNamespace(exitcode=c, local_rank=r, signal_name=lambda: "SIGTERM")
            for r, c in enumerate(codes)
        }
        return SimpleNamespace(failures=failures)

    assert _failure_lines(failed(143, 143), relayed=True) == ([], 143)
    assert _failure_lines(failed(143, -signal.SIGTERM), relayed=True) == ([], 143)
    assert _failure_lines(failed(128 + signal.SIGUSR1), relayed=True) == ([], 128 + signal.SIGUSR1)
    assert _failure_lines(failed(130, 130), relayed=True) == ([], 130)
    lines, code = _failure_lines(failed(143, 1), relayed=True)  # a crash is still a crash
    assert code == 1 and len(lines) == 2
    lines, code = _failure_lines(failed(143), relayed=False)  # a rank signalled by someone else
    assert code == 1 and len(lines) == 1
