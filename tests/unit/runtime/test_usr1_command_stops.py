"""SIGUSR1 (SLURM's ``--signal`` warning before a time limit) to precompute or export: the same stop as SIGTERM
(``STOP.quit_on_stop``), not the default action. The command's cleanup runs, nothing partial is left where a
complete output would be, one line says so, and the exit status is 128 + SIGUSR1 (138, docs/operations.md:
precompute and export have nothing to resume, so not 75, which tells a scheduler "a checkpoint: resume me").

A real process, sent the signal by this one while it writes (no self-kill), importing only coati_kto.runtime."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

_CHILD = """
import sys, time
from pathlib import Path
from coati_kto.runtime import durable
from coati_kto.runtime.signals import STOP

command, root = sys.argv[1], Path(sys.argv[2])
target = root / "step-2"
STOP.quit_on_stop(command)
STOP.leaves(lambda: "complete" if (target / "done").is_file() else f"nothing written to {target.name}")

def write(scratch):
    (scratch / "part-0").write_text("half")
    print("writing", flush=True)
    for i in range(200):  # 20 s: the signal comes long before
        time.sleep(0.1)
        (scratch / f"part-{i + 1}").write_text("more")
    (scratch / "done").write_text("complete")

STOP.stoppable(lambda: durable.write_dir(target, write))
print("finished", flush=True)
"""


@pytest.mark.parametrize("command", ["precompute", "export"])
def test_sigusr1_mid_write_stops_like_sigterm_and_leaves_nothing_partial(
    tmp_path: Path, command: str
) -> None:
    (tmp_path / "step-1").mkdir()  # an earlier, complete output: only read
    (tmp_path / "step-1" / "done").write_text("intact")
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, command, str(tmp_path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == "writing\n", child.communicate(timeout=30)
        child.send_signal(signal.SIGUSR1)
        time.sleep(0.05)
        child.send_signal(signal.SIGUSR1)  # SLURM may deliver the warning twice: it changes nothing
        out, err = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 128 + signal.SIGUSR1, (out, err)
    assert (out, err) == ("", f"{command} stopped by SIGUSR1: nothing written to step-2\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]  # no step-2, no scratch folder
    assert (tmp_path / "step-1" / "done").read_text() == "intact"
