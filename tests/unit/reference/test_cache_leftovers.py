"""A reference-cache writer killed mid-write (SIGKILL, the OOM killer) left ``reference_cache/.DIGEST.tmp-*`` for
good: no lock, no sweep. The cache is now written in a build folder of coati_kto.data.build_folder (held by its
writer's flock), and the next look-up removes every such folder whose writer is gone, in one line, and leaves a
live writer's alone."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from helpers import MINIMAL, write_config

import coati_kto.reference.cache as cache
from coati_kto.config.load import load_config
from coati_kto.reference.settings import ReferenceSettings

# A writer of the reference cache ``sys.argv[1]`` that stops just before its rename: says its folder, then waits.
WRITER = """
import sys, time
from pathlib import Path
import numpy as np
import coati_kto.reference.cache as cache

def hold(directory, work, key, rows):
    print(work.name, flush=True)
    time.sleep(600)

cache._replace = hold
cache._write(Path(sys.argv[1]), {"digest": "x"}, {"train": np.zeros((3, 2), np.float32)}, 0.0)
"""


def _writer(directory: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(directory)], stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def test_a_killed_writers_folder_goes_at_the_next_look_up_and_a_live_ones_stays(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\x01" * 64)
    (model / "config.json").write_text("{}")
    overrides = [f"model.path={model}", f"data.prepared_dir={tmp_path / 'prepared'}"]
    config = load_config(write_config(tmp_path, MINIMAL), overrides)
    settings = ReferenceSettings(config.model, config.data, config.kto, torch.float32)
    root = tmp_path / "prepared" / cache.CACHE_DIR
    scores = np.arange(6, dtype=np.float32).reshape(3, 2)
    monkeypatch.setattr(cache, "score_splits", lambda *args: {"train": scores})
    data = SimpleNamespace(train=[0, 1, 2], eval=None, stats={"fingerprint": "data-digest"})

    digest = cache.cache_key(settings, "data-digest", cache.weights_hash(str(model)))["digest"]
    # one writer of a key this look-up does not compute (killed), one of the key it computes (alive)
    killed, killed_name = _writer(root / "0123456789abcdef")
    live, live_name = _writer(root / digest)
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        assert (root / killed_name).is_dir() and (root / live_name).is_dir()
        legacy = root / ".0123456789abcdef.tmp-0123abcd"  # an older version's: no lock, whose cannot be known
        legacy.mkdir()

        values = cache.ensure_reference_cache(settings, data, 0)
        lines = capsys.readouterr().out.splitlines()
        assert lines[0] == (
            f"the reference cache {root}: removed 1 unfinished build folder(s) of processes that were killed: "
            f"{killed_name}"
        )
        assert lines[1].startswith("reference log-probs: computing 3 examples") and len(lines) == 2
        assert np.array_equal(values["train"], scores)
        left = sorted(p.name for p in root.iterdir() if p.name != "weights_sha256.json")
        assert left == sorted([digest, legacy.name, live_name, f"{live_name}.lock"])

        cache.ensure_reference_cache(settings, data, 0)  # nothing more to sweep: the live writer's stays
        assert capsys.readouterr().out.splitlines() == [f"reference log-probs: reusing {root / digest}"]
        assert (root / live_name).is_dir()
    finally:
        live.kill()
        live.wait()


# A writer that replaces the damaged cache ``sys.argv[1]`` and stops once it has set it aside, before deleting it:
# says the name it was set aside under, then waits.
REPLACER = """
import sys, time
from pathlib import Path
import numpy as np
import coati_kto.reference.cache as cache

def hold(path, ignore_errors=False):
    print(Path(path).name, flush=True)
    time.sleep(600)

def damaged(directory, key, rows):
    raise ValueError("checksum")

cache.shutil.rmtree = hold
cache._read = damaged
cache._write(Path(sys.argv[1]), {"digest": "x"}, {"train": np.zeros((3, 2), np.float32)}, 0.0)
"""


def _replacer(directory: Path) -> tuple[subprocess.Popen, str]:
    directory.mkdir(parents=True)
    (directory / "meta.json").write_text("{")  # damaged
    proc = subprocess.Popen(
        [sys.executable, "-c", REPLACER, str(directory)], stdout=subprocess.PIPE, text=True
    )
    return proc, proc.stdout.readline().strip()


def test_a_damaged_cache_a_killed_writer_had_set_aside_goes_at_the_next_sweep(tmp_path: Path, capsys) -> None:
    """``.DIGEST.old-XXXXXXXX`` (the damaged cache, renamed aside so that readers find a whole cache or none) was
    left for good by a kill before its deletion: nothing swept it. Now it is named after its writer's build folder
    and goes with that folder's lock once the writer is gone; a live writer's stays."""
    root = tmp_path / cache.CACHE_DIR
    killed, killed_aside = _replacer(root / "0123456789abcdef")
    live, live_aside = _replacer(root / "fedcba9876543210")
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        assert killed_aside.startswith(".0123456789abcdef.old-") and (root / killed_aside).is_dir()
        assert (root / "0123456789abcdef" / "train.npy").is_file()  # the new cache is in place
        cache._sweep(root)
        assert capsys.readouterr().out.splitlines() == [
            f"the reference cache {root}: removed 1 set-aside old copy(ies) of processes that were killed: "
            f"{killed_aside}"
        ]
        assert not (root / killed_aside).exists() and not list(root.glob(".0123456789abcdef.tmp-*.lock"))
        assert (root / live_aside).is_dir() and (root / "0123456789abcdef" / "train.npy").is_file()
        cache._sweep(root)  # the live writer's aside is its own to delete
        assert capsys.readouterr().out == "" and (root / live_aside).is_dir()
    finally:
        live.kill()
        live.wait()
