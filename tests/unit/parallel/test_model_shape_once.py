"""model_shape meta-builds a model once per config.json content in a process: a training run's load check and its
plan line (and the reference's shape in each) asked for the same models and built each twice. The shape follows
the file's content, not its path: a config.json edited in place is built again, and an error names its own source."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from coati_kto.errors import ConfigError
from coati_kto.parallel import model_shape as shapes


def test_one_build_per_config_content(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[int] = []  # the layer count of each meta model counted
    count = shapes._count

    def counted(model: object, text: object) -> shapes.ModelShape:
        built.append(int(text.num_hidden_layers))  # type: ignore[attr-defined]
        return count(model, text)

    monkeypatch.setattr(shapes, "_count", counted)
    monkeypatch.setattr(shapes, "_BUILT", {}, raising=False)
    copy = shutil.copytree(tiny_model_dir, tmp_path / "copy")
    first = shapes.model_shape(str(tiny_model_dir))
    assert shapes.model_shape(str(tiny_model_dir)) is first
    assert shapes.model_shape(str(copy), "model.reference_path") is first  # the same config.json, elsewhere
    assert built == [first.layers]
    raw = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": raw["num_hidden_layers"] + 1}))
    deeper = shapes.model_shape(str(copy))
    assert deeper.layers == first.layers + 1 and deeper.split_params > first.split_params
    assert built == [first.layers, deeper.layers]
    (copy / "config.json").write_text(json.dumps({**raw, "model_type": "no_such_type"}))
    for _ in range(2):  # a refusal is not kept: each asks and is told in its own words
        with pytest.raises(ConfigError, match=r"^model.reference_path: .*copy: model_type 'no_such_type'"):
            shapes.model_shape(str(copy), "model.reference_path")
