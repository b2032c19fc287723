"""The reference cache's memo of weight-file hashes: a file put in place with another's content is hashed again."""

from __future__ import annotations

import os
from pathlib import Path

from coati_kto.reference.weights import weights_hash


def test_weights_saved_over_with_their_old_timestamps_are_hashed_again(tmp_path: Path) -> None:
    """The memo used to key a file's hash on (path, size, mtime): weights of the same shapes put in place with
    the old timestamp (``tar`` of a build with fixed mtimes, ``cp -p``, ``rsync -t``) kept the old hash, and a
    stale reference cache was used in silence."""
    model, memo = tmp_path / "model", tmp_path / "memo.json"
    model.mkdir()
    weights = model / "model.safetensors"
    weights.write_bytes(b"\x01" * 4096)
    (model / "config.json").write_text("{}")
    stamp = weights.stat()
    first = weights_hash(str(model), memo)
    staged = tmp_path / "staged.safetensors"
    staged.write_bytes(b"\x02" * 4096)  # another checkpoint of the same shapes: same size
    os.utime(staged, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))  # with the old timestamp
    os.replace(staged, weights)
    assert weights.stat().st_size == stamp.st_size and weights.stat().st_mtime_ns == stamp.st_mtime_ns
    assert weights_hash(str(model), memo) == weights_hash(str(model)) != first


def test_checkpoints_kept_under_the_model_directory_leave_the_key_alone(tmp_path: Path) -> None:
    """from_pretrained reads the top level only: a Trainer's checkpoint-N/ (weights and optimizer state) kept in
    the SFT output that model.path names changed the key (the whole reference rescored) and was hashed in full."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\x01" * 4096)
    (model / "config.json").write_text("{}")
    before = weights_hash(str(model))
    nested = model / "checkpoint-500"
    nested.mkdir()
    (nested / "model.safetensors").write_bytes(b"\x02" * 4096)
    (nested / "optimizer.pt").write_bytes(b"\x03" * 8192)
    (nested / "config.json").write_text('{"x": 1}')
    assert weights_hash(str(model)) == before
    (model / "model.safetensors").write_bytes(b"\x04" * 4096)
    assert weights_hash(str(model)) != before  # its own weights still count


def test_an_interrupted_memo_write_leaves_no_partial_file(tmp_path: Path, monkeypatch) -> None:
    """The memo is written to a temporary name, then renamed: an interruption between the two (precompute ends at
    once on a stop signal) left the partial `.memo.json.XXXXXXXX` beside it for good."""
    import pytest

    model, memo = tmp_path / "model", tmp_path / "cache" / "memo.json"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\x01" * 4096)
    (model / "config.json").write_text("{}")

    def interrupted(self: Path, target: Path) -> None:
        raise KeyboardInterrupt  # as a stop's exception, raised between the write and the rename

    monkeypatch.setattr(Path, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        weights_hash(str(model), memo)
    assert list(memo.parent.iterdir()) == []


def test_a_model_that_ships_its_code_is_keyed_on_that_code(tmp_path: Path) -> None:
    """With model.trust_remote_code the forward is the directory's modeling_*.py: an edit of it (a fixed rotary,
    another mask) changes the reference's log-probs, and the cache key held only the weights and config.json,
    so the old cache was used in silence."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\x01" * 4096)
    (model / "config.json").write_text('{"auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}}')
    (model / "modeling_x.py").write_text("SCALE = 1.0\n")
    before = weights_hash(str(model))
    (model / "modeling_x.py").write_text("SCALE = 0.5\n")
    assert weights_hash(str(model)) != before
    (model / "modeling_x.py").write_text("SCALE = 1.0\n")
    (model / "README.md").write_text("notes")  # what the forward does not read leaves it alone
    assert weights_hash(str(model)) == before
