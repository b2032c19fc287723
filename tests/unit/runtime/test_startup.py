"""The collector held off while a coati-kto process imports (coati_kto.runtime.startup, coati_kto.cli.entry)."""

from __future__ import annotations

import gc
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from coati_kto.runtime import startup


@pytest.fixture
def collector() -> Iterator[None]:
    """This worker's collector as it was, afterwards: enabled, nothing frozen by the test, nothing held."""
    frozen = gc.get_freeze_count()
    yield
    startup._held = False
    gc.enable()
    if gc.get_freeze_count() > frozen:
        gc.unfreeze()
        if frozen:  # what the suite froze before the test (tests/conftest.py) stays frozen
            gc.freeze()


def test_hold_then_release_freezes_and_enables(collector: None) -> None:
    startup.hold_collection()
    assert not gc.isenabled()
    made = [[] for _ in range(1000)]
    before = gc.get_freeze_count()
    startup.release_collection()
    assert gc.isenabled() and gc.get_freeze_count() >= before + len(made)
    startup.release_collection()  # a second call changes nothing
    assert gc.isenabled()


def test_release_without_hold_does_nothing(collector: None) -> None:
    """Library use and the worker ranks never hold: release must not freeze their objects."""
    frozen = gc.get_freeze_count()
    startup.release_collection()
    assert gc.isenabled() and gc.get_freeze_count() <= frozen  # frozen objects freed meanwhile count down
    gc.disable()  # turned off by someone else: not ours to turn on
    startup.release_collection()
    assert not gc.isenabled()
    gc.enable()


class _SetupReachedError(Exception):
    pass


def test_train_through_the_entry_point_releases_before_setup(
    collector: None, tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``coati-kto train``: the collector is off from the entry point through the imports (ColossalAI's booster
    included) and on, with the imports frozen, when setup starts building; on again after any way out."""
    import coati_kto.cli as cli
    import coati_kto.recipe.train as recipe

    seen: dict[str, object] = {}
    run = cli._run

    def run_noting(args: object) -> int:
        seen["at_entry"] = gc.isenabled()
        return run(args)

    def setup_noting(config: object, heartbeat: object) -> None:
        seen.update(
            at_setup=gc.isenabled(), frozen=gc.get_freeze_count(), booster="colossalai.booster" in sys.modules
        )
        raise _SetupReachedError

    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"q{i}", "completion": "a", "label": i % 2 == 0}) + "\n" for i in range(8)
        )
    )
    config = tmp_path / "config.yaml"
    config.write_text(
        f"model: {{path: {tiny_model_dir}}}\ndata: {{train_files: [{data}], prepared_dir: {tmp_path / 'prepared'}}}\n"
        f"output: {{dir: {tmp_path / 'out'}}}\nlogging: {{tensorboard: false}}\n"
    )
    monkeypatch.setattr(cli, "_run", run_noting)
    monkeypatch.setattr(recipe, "setup_training", setup_noting)
    monkeypatch.setattr(sys, "argv", ["coati-kto", "train", str(config)])
    frozen = gc.get_freeze_count()
    with pytest.raises(_SetupReachedError):
        cli.entry()
    assert seen["at_entry"] is False
    assert seen["at_setup"] is True and seen["booster"] is True
    assert seen["frozen"] > frozen  # what the imports made (and the worker had) is frozen
    assert gc.isenabled()


def test_a_reader_that_leaves_early_is_no_traceback(tmp_path: Path) -> None:
    """From a docs audit: `coati-kto inspect CONFIG | head -1` ended in a 22-line BrokenPipeError traceback (exit
    1). A closed stdout now ends the command quietly with a shell tool's 141."""
    import subprocess
    import sys

    script = (
        "import sys\nfrom coati_kto.runtime.startup import closed_stdout_is_quiet\n"
        "def many() -> int:\n    for i in range(200000):\n        print('row', i)\n    return 0\n"
        "sys.exit(closed_stdout_is_quiet(many))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"row 0\n"
    proc.stdout.close()  # what head does after its line
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (141, b"")
