"""``--nproc-per-node N`` in a process that already is a rank (RANK set: an srun step, torchrun, a shell that
leaked RANK) was ignored: one process, no warning. It is one line naming the option and the variable, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from coati_kto.errors import UserError


@pytest.mark.parametrize("command", ["train", "precompute", "export"])
def test_nproc_per_node_in_a_rank_is_refused(command: str, tmp_path: Path) -> None:
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1"}
    argv = [sys.executable, "-m", "coati_kto", command, str(tmp_path / "cfg.yaml"), "--nproc-per-node", "2"]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "--nproc-per-node 2" in lines[0] and "RANK=0" in lines[0]


def test_without_rank_nproc_per_node_launches(monkeypatch) -> None:
    from coati_kto.runtime.signals import launches

    monkeypatch.delenv("RANK", raising=False)
    assert launches("train", 2) and launches("export", 1)
    assert not launches("train", None) and not launches("prepare", 2)
    monkeypatch.setenv("RANK", "3")
    assert not launches("train", None)  # a rank of a launcher, as torchrun's workers are started
    with pytest.raises(UserError, match="RANK=3"):
        launches("precompute", 2)
