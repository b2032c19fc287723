"""A stop signal while a one-process command is still importing (``coati_kto.cli.entry``'s first step on).

Deterministic: the child sends itself the signal from an import hook, at the import named, instead of racing a
``kill`` against the imports. One process each (no launcher): a few seconds of imports.

- Ctrl-C inside torch's import of numpy (``numpy._core.arrayprint``, imported by torch's C extension, which
  clears the error): the KeyboardInterrupt was lost, the half-imported numpy failed transformers' next import,
  and ``coati-kto plan`` said ``error: model.path: ...: transformers cannot build its config.json``, exit 2.
- SIGUSR1 (SLURM's ``--signal`` warning) had its default action: plan, and train until its handlers, died with
  no line (-10). plan now quits as the read-only commands do (one line, 128 + the signal); train keeps it for its
  first step, as a launcher keeps it for its ranks: a checkpoint, exit 75.
- Ctrl-C while the command line is read (``--seed`` imports the config's schema): a traceback.
- SIGTERM while a one-process train imports: the default action, exit 143 with no line. It is kept for the
  first step now, as SIGUSR1 is (and as a launched run's ranks keep it): a checkpoint, exit 75.
- tiny-model: SIGTERM and SIGUSR1 had the default action; it quits now as plan does (one line, 128 + the
  signal; its folder whole or as it was: tests/unit/runtime/test_tiny_model_stop.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import PLAN_CONFIG, write_config

from coati_kto.runtime.signals import ABORT_EXIT_CODE, STOP_EXIT_CODE

_CHILD = """
import os, signal, sys

target, signame = sys.argv[1], sys.argv[2]


class SignalAt:
    # Sends the signal as the module named starts importing, once; finds nothing itself.
    def find_spec(self, name, path=None, target_=None):
        if name == target and self in sys.meta_path:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), getattr(signal, signame))
        return None


sys.meta_path.insert(0, SignalAt())
sys.argv = ["coati-kto", *sys.argv[3:]]
from coati_kto.cli import entry

sys.exit(entry())
"""


def _signalled_at(module: str, signame: str, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    """``coati-kto ARGV`` in a fresh process that sends itself ``signame`` as ``module`` starts importing."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    return subprocess.run(
        [sys.executable, "-c", _CHILD, module, signame, *argv],
        cwd=cwd,
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_ctrl_c_inside_torchs_numpy_import_ends_plan_as_interrupted(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = write_config(tmp_path, PLAN_CONFIG.format(model=tiny_model_dir))
    done = _signalled_at("numpy._core.arrayprint", "SIGINT", "plan", str(config), "--gpus", "2", cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (
        ABORT_EXIT_CODE,
        "",
        "plan stopped by SIGINT: nothing written\n",
    )


def test_sigusr1_while_plan_imports_is_a_stop_not_a_kill(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = write_config(tmp_path, PLAN_CONFIG.format(model=tiny_model_dir))
    done = _signalled_at("torch", "SIGUSR1", "plan", str(config), cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (
        128 + signal.SIGUSR1,
        "",
        "plan stopped by SIGUSR1: nothing written\n",
    )


def test_ctrl_c_while_the_command_line_is_read_is_one_line(tmp_path: Path) -> None:
    done = _signalled_at("yaml", "SIGINT", "train", str(tmp_path / "missing.yaml"), cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (
        ABORT_EXIT_CODE,
        "",
        "interrupted before training started: nothing to save\n",
    )


@pytest.mark.parametrize("signame, module", [("SIGINT", "yaml"), ("SIGTERM", "torch"), ("SIGUSR1", "torch")])
def test_a_stop_while_tiny_model_imports_quits_it(tmp_path: Path, signame: str, module: str) -> None:
    """tiny-model quits as the other short commands do: one line, 128 + the signal (SIGTERM and SIGUSR1 had the
    default action: no line; a Ctrl-C said ``coati-kto tiny-model interrupted``)."""
    out = tmp_path / "tiny"
    done = _signalled_at(module, signame, "tiny-model", str(out), "--seed", "1", cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (
        128 + getattr(signal, signame),
        "",
        f"tiny-model stopped by {signame}: nothing written\n",
    )
    assert sorted(tmp_path.iterdir()) == []


@pytest.mark.parametrize("signame", ["SIGUSR1", "SIGTERM"])
def test_a_stop_while_a_one_process_train_imports_stops_it_after_step_1(
    tmp_path: Path, tiny_model_dir: Path, signame: str
) -> None:
    """SLURM's warning and a scheduler's SIGTERM count as train's stop: one step, its checkpoint, the stop line,
    exit 75 (a scheduler's "resume me"), as for a launched run's ranks, where the default action killed the
    process as it imported torch (SIGTERM: exit 143, no line)."""
    data = tmp_path / "train.jsonl"
    good, bad = "The capital of France is Paris.", "I cannot help with that."
    data.write_text(
        "".join(
            f'{{"prompt": "Question {i}?", "completion": "{good if i % 2 else bad}", "label": {str(bool(i % 2)).lower()}}}\n'
            for i in range(8)
        )
    )
    out = tmp_path / "out"
    config = write_config(
        tmp_path,
        f"model:\n  path: {tiny_model_dir}\ndata:\n  train_files: [{data}]\n  prepared_dir: {tmp_path / 'prepared'}\n"
        f"  max_length: 64\ntrain:\n  micro_batch_size: 2\n  max_steps: 4\noutput:\n  dir: {out}\n"
        "  save_interval: 100\n",
    )
    done = _signalled_at("torch", signame, "train", str(config), cwd=tmp_path)
    assert done.returncode == STOP_EXIT_CODE, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert lines[0] == (
        f"{signame} received: stopping after the current optimizer step (checkpoint, then exit 75); Ctrl-C again "
        "to abort at once"
    )
    assert lines[-1] == (
        f"stopped by {signame} after step 1; checkpoint {out}/checkpoints/step-1; resume with train.resume=auto"
    )
    assert "Traceback" not in done.stderr
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-1"


_SWALLOWED = """
import os, signal, sys, time
from pathlib import Path

from coati_kto.cli import main
from coati_kto.runtime.signals import STOP

STOP.block_for_launcher(sys.argv[1:])  # entry's first step, for `coati-kto train FILE`
try:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
except KeyboardInterrupt:
    pass  # as torch's C extension does with an import's error
print("exit", main(sys.argv[1:]), flush=True)
try:
    STOP.install()
    print("train's handlers installed", flush=True)
except KeyboardInterrupt:
    print("KeyboardInterrupt again", flush=True)
"""


def test_a_swallowed_ctrl_c_is_still_the_commands_interrupt(tmp_path: Path) -> None:
    """Where a library swallows the KeyboardInterrupt, the error it leaves behind (here a real user mistake,
    a config file that is missing) is reported as the interrupt, and train's handlers are not installed over
    it: ``STOP.install`` raises it again (the command ends before anything trains)."""
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    done = subprocess.run(
        [sys.executable, "-c", _SWALLOWED, "train", str(tmp_path / "missing.yaml")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stdout, done.stderr) == (
        0,
        f"exit {ABORT_EXIT_CODE}\nKeyboardInterrupt again\n",
        "interrupted before training started: nothing to save\n",
    )
