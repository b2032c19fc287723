"""Chat templates that date each prompt (transformers' ``strftime_now``: Llama 3.1-3.3's "Today Date:").

Before: every render read the real clock. A build that ran past midnight rendered a record's prompt on one day and
its whole conversation on the next, so the prompt was no prefix of it: a bad record (skipped in silence under
``data.on_bad_record: skip``). A build on another day gave other tokens under the same fingerprint, and a resume
took them as the same training data. Now a build renders as of its start's day, records it (``template_date``),
says so in the summary, and a resume across two days' builds is refused naming it.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest
from helpers import CORPUS, data_settings
from test_prepare import make_config
from transformers import AutoTokenizer

from coati_kto.config.resume import check_training_data
from coati_kto.data import template_clock
from coati_kto.data.files import write_jsonl
from coati_kto.data.prepared import prepare
from coati_kto.data.train_data import train_data_parts
from coati_kto.errors import ConfigError
from coati_kto.testing.tiny import build_llama, build_tokenizer

DATED = (  # Llama 3.2's date logic, abridged
    "{{ bos_token }}{% if not date_string is defined %}{% set date_string = strftime_now('%d %b %Y') %}{% endif %}"
    "<|start_header_id|>system<|end_header_id|>\n\nToday Date: {{ date_string }}<|eot_id|>"
    "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


class _EveryCallANewDay(dt.datetime):
    """A clock that moves a day on each reading: each render of a build that crosses midnight, at its worst."""

    calls = 0

    @classmethod
    def now(cls, tz: dt.tzinfo | None = None) -> dt.datetime:
        cls.calls += 1
        return dt.datetime(2026, 1, 9) + dt.timedelta(days=cls.calls)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    tok = build_tokenizer([*CORPUS, "Today Date: Jan 2026 system user assistant"] * 2, 400, style="llama3")
    tok.chat_template = DATED
    out = tmp_path / "model"
    build_llama(tok, hidden_size=32, num_layers=1).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _prepare(tmp_path: Path, model: Path, name: str):
    rows = [
        {"messages": [{"role": "user", "content": f"Add {i} and 3."}, {"role": "assistant", "content": "5"}],
         "label": i % 3 != 0}
        for i in range(12)
    ]  # fmt: skip
    data = write_jsonl(rows, tmp_path / name / "data.jsonl")
    config = make_config(tmp_path / name, model, [str(data)], on_bad_record="skip")
    return prepare(*data_settings(config))


def test_a_build_renders_as_of_its_day_whatever_the_clock_does(
    tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers.utils import chat_template_utils

    monkeypatch.setattr(chat_template_utils, "datetime", _EveryCallANewDay)
    monkeypatch.setattr(template_clock, "today", lambda: dt.date(2026, 1, 9))
    out = _prepare(tmp_path, model, "a")
    assert out.stats["bad_records"]["skipped"] == 0 and len(out.train) == 12  # before: every record bad
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [tok.decode(r["input_ids"][: r["completion_start"]]) for r in out.train]
    assert all("Today Date: 09 Jan 2026<|eot_id|>" in p for p in prompts), prompts[0]
    assert out.stats["template_date"] == "2026-01-09"
    for name in ("stats.json", "fingerprint.json"):
        assert json.loads((tmp_path / "a" / "prepared" / name).read_text())["template_date"] == "2026-01-09"
    assert "dates each prompt (strftime_now): rendered as of 2026-01-09" in capsys.readouterr().out
    assert chat_template_utils.datetime is _EveryCallANewDay  # the clock it found is back after the build


def test_a_rebuild_on_another_day_is_named_by_a_refused_resume(
    tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(template_clock, "today", lambda: dt.date(2026, 1, 9))
    first = _prepare(tmp_path, model, "a")
    monkeypatch.setattr(template_clock, "today", lambda: dt.date(2026, 1, 10))
    second = _prepare(tmp_path, model, "b")
    decoded = [out.train[0]["input_ids"] for out in (first, second)]
    assert decoded[0] != decoded[1]  # "09 Jan 2026" and "10 Jan 2026" in the prompt
    parts = [train_data_parts({**p, "train_files": []}) for p in (first.stats, second.stats)]
    assert [p["template_date"] for p in parts] == ["2026-01-09", "2026-01-10"]
    with pytest.raises(
        ConfigError, match=r"the day the chat template dates its prompts \(2026-01-09 -> 2026-01-10"
    ):
        check_training_data("same", "same", "step-4", (parts[0], parts[1]))
    check_training_data("same", "same", "step-4", (parts[0], parts[0]))  # the same day: resumes
    check_training_data("same", "same", "step-4", ({"files": []}, parts[1]))  # a checkpoint before the date
    # A template that reads no clock records no day, and a resume checks none.
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = DATED.replace("strftime_now('%d %b %Y')", "'26 Jul 2024'")
    tok.save_pretrained(model)
    third = _prepare(tmp_path, model, "c")
    assert (
        "template_date" not in third.stats and train_data_parts({"train_files": []})["template_date"] is None
    )
