"""The model card travels alone (uploaded with final/): it embeds the config and says what the run chose."""

from __future__ import annotations

from pathlib import Path

import yaml
from helpers import MINIMAL, write_config

from coati_kto.config.load import load_config
from coati_kto.trainer.model_card import render


def test_card_embeds_the_config_and_the_run_notes(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path, MINIMAL), ["train.lr=5e-4"])
    notes = ["resume: 1 setting(s) differ from step-6's config, applied: train.lr 0.001 -> 0.0005"]
    card = render(config, None, None, 12, (0.5, 1.0), 2, notes)
    assert "../config.yaml" not in card  # a link that dangles once final/ is uploaded on its own
    assert f"- {notes[0]}" in card
    embedded = card.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert yaml.safe_load(embedded) == config.model_dump(mode="json")
