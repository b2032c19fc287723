"""Test artifacts under a content address (coati_kto.testing.built): built once, rebuilt when the builder, its
inputs or the files change, never handed out half-built."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from coati_kto.testing import built as store


class Builder:
    """Writes ``weights.bin`` holding ``text``; counts its calls."""

    def __init__(self, text: str = "w", fail: bool = False) -> None:
        self.text, self.fail, self.calls = text, fail, 0

    def __call__(self, out: Path) -> None:
        self.calls += 1
        (out / "weights.bin").write_text(self.text)
        if self.fail:
            raise RuntimeError("the build broke")


def test_built_once_then_reused_and_other_inputs_get_their_own_directory(tmp_path: Path) -> None:
    build = Builder()
    first = store.built(tmp_path, "tiny", build, {"vocab_size": 300})
    again = store.built(tmp_path, "tiny", build, {"vocab_size": 300})
    other = store.built(tmp_path, "tiny", build, {"vocab_size": 280})
    assert first == again != other and build.calls == 2
    assert first.name == f"tiny-{store.content_key('tiny', {'vocab_size': 300})}"
    assert (first / "weights.bin").read_text() == "w" and (first / store.COMPLETE).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, other.name])  # no staging left


def test_a_changed_builder_module_gets_a_new_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = tmp_path / "fake_builder_module.py"
    module.write_text("SIZE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(store, "BUILDER_MODULES", (*store.BUILDER_MODULES, "fake_builder_module"))
    before = store.content_key("tiny", {})
    module.write_text("SIZE = 2\n")
    assert store.content_key("tiny", {}) != before
    sys.modules.pop("fake_builder_module", None)


def test_a_failed_build_leaves_nothing_that_counts(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="the build broke"):
        store.built(tmp_path, "tiny", Builder(fail=True), {})
    assert list(tmp_path.iterdir()) == []
    build = Builder()
    assert (store.built(tmp_path, "tiny", build, {}) / "weights.bin").read_text() == "w" and build.calls == 1


def test_files_changed_after_the_build_are_built_again(tmp_path: Path) -> None:
    build = Builder()
    path = store.built(tmp_path, "tiny", build, {})
    (path / "weights.bin").write_text("saved over by a test")
    assert store.built(tmp_path, "tiny", build, {}) == path and build.calls == 2
    assert (path / "weights.bin").read_text() == "w"


def test_a_leftover_without_its_marker_is_replaced(tmp_path: Path) -> None:
    leftover = tmp_path / f"tiny-{store.content_key('tiny', {})}"
    leftover.mkdir()
    (leftover / "weights.bin").write_text("half")
    build = Builder()
    assert store.built(tmp_path, "tiny", build, {}) == leftover and build.calls == 1
    assert (leftover / "weights.bin").read_text() == "w"


def test_the_session_fixtures_share_one_built_model(tiny_family_dir, built_root: Path) -> None:
    """Two tests asking for one family get one directory, built under the session's root."""
    first, again = tiny_family_dir("qwen3"), tiny_family_dir("qwen3")
    assert first == again and first.parent == built_root
    assert {"config.json", "tokenizer.json", store.COMPLETE} <= {p.name for p in first.iterdir()}
    assert tiny_family_dir("qwen3", vocab_size=280) != first
