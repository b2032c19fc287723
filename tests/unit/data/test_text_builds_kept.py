"""A text-only prepared folder built before the image layout changed is reused after it, with its reference cache:
the image layout has its own marker in an image build's fingerprint (store.IMAGE_LAYOUT) and a text-only
fingerprint is the one version 8 wrote. d64be4b bumped PIPELINE_VERSION to 9 for the image layout instead: every
text-only folder read as "changed: version" after an upgrade, was rebuilt, and its reference caches (a forward
pass over the whole data set) were dropped and scored again."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import data_settings
from test_data_formats import write_jsonl
from test_prepare import make_config, rows

import coati_kto.reference.cache as cache
from coati_kto.data.prepared import prepare
from coati_kto.data.prepared_read import read_prepared
from coati_kto.reference.settings import ReferenceSettings


def as_version_8_wrote_it(fp: dict) -> dict:
    """``fp`` with version 8 and the digest version 8's ``store.fingerprint`` gave it (5a4411b: SHA-256 of the
    parts as sorted JSON, 16 hex digits; ``template_date`` is added after the digest, by the build)."""
    parts = {k: v for k, v in fp.items() if k not in ("digest", "template_date")} | {"version": 8}
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]
    return {
        **parts,
        "digest": digest,
        **({"template_date": fp["template_date"]} if "template_date" in fp else {}),
    }


def test_a_version_8_text_build_is_reused_with_its_reference_cache(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch, capsys
) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", rows(6, 4))
    config = make_config(tmp_path, tiny_model_dir, [str(path)], eval_fraction=0.25)
    settings, weights = data_settings(config)
    prepare(settings, weights)
    prepared = tmp_path / "prepared"
    # The folder as version 8's prepare left it (its text rows are this code's: no text row changed since 8): its
    # fingerprint, and stats.json's record of it, which the reference cache's key reads.
    fp = as_version_8_wrote_it(json.loads((prepared / "fingerprint.json").read_text()))
    assert "images" not in fp and "image_layout" not in fp
    (prepared / "fingerprint.json").write_text(json.dumps(fp, indent=2))
    stats = json.loads((prepared / "stats.json").read_text()) | {"version": 8, "fingerprint": fp["digest"]}
    (prepared / "stats.json").write_text(json.dumps(stats, indent=2))
    reference = ReferenceSettings(config.model, config.data, config.kto, torch.float32)
    # the version-8 folder as a run opens it; its reference cache is keyed on that digest (stats.json's)
    data = read_prepared(prepared)
    scored = {s: np.full((len(getattr(data, s)), 2), -1.5, np.float32) for s in ("train", "eval")}
    monkeypatch.setattr(cache, "score_splits", lambda *args: scored)
    cache.ensure_reference_cache(reference, data, 0)
    capsys.readouterr()

    data = prepare(settings, weights)  # after the upgrade
    reused = f"reusing {prepared} (inputs, tokenizer and settings unchanged; fingerprint {fp['digest']})"
    assert capsys.readouterr().out.startswith(reused + "\n")
    assert json.loads((prepared / "fingerprint.json").read_text()) == fp
    assert data.stats["fingerprint"] == fp["digest"] and data.stats["version"] == 8

    def never(*args):
        pytest.fail("the reference cache was scored again")

    monkeypatch.setattr(cache, "score_splits", never)
    values = cache.ensure_reference_cache(reference, data, 0)
    assert capsys.readouterr().out.startswith("reference log-probs: reusing ")
    assert {s: v.tolist() for s, v in values.items()} == {s: v.tolist() for s, v in scored.items()}
