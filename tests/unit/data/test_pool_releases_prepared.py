"""A pooled test worker between tasks holds no prepared build: a task's load_prepared (no command's release) left
rank 0's reader file held for the rest of the session, refusing another process's build of other settings there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from coati_kto.data import prepared_lock
from coati_kto.testing.isolation import FreshState

_PROBE = """
import sys
from pathlib import Path
from coati_kto.data.prepared_lock import deciding, refuse_if_read
from coati_kto.errors import DataError
with deciding(Path(sys.argv[1])):
    try:
        refuse_if_read(Path(sys.argv[1]), "changed: max_length")
    except DataError as err:
        print(err)
"""


def test_a_tasks_prepared_build_is_released_between_tasks(tmp_path: Path) -> None:
    target = tmp_path / "prepared"
    fresh = FreshState.take()
    with prepared_lock.deciding(target):  # what ensure does for a task's load_prepared on rank 0
        prepared_lock.read_from_now(target)
    readers = sorted(tmp_path.glob(".prepared.coati-kto.*.reader"))
    assert len(readers) == 1
    fresh.restore()
    assert sorted(tmp_path.glob(".*")) == [] and prepared_lock._READING == {}
    # another process now builds there without a refusal
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(target)], capture_output=True, text=True, check=True
    )
    assert out.stdout == ""
