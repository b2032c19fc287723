"""The day chat templates render as of during one build of the prepared data.

Templates that date each prompt call transformers' ``strftime_now`` (Llama 3.1-3.3's "Today Date:", Mistral
Small 3's, SmolLM3's): a build that ran past midnight rendered prompts that were no prefix of their own
conversations (every later record a bad record), and a build on another day other tokens under the same
fingerprint, which a resume took as the same data. A build now renders as of one day, its start's, at 00:00
(:func:`rendered_as_of`); the day is recorded (``template_date`` in stats.json and fingerprint.json) and is part
of what a resume checks (``coati_kto.data.train_data``).
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Iterator
from typing import Any

_BUILD_DAY: dt.date | None = None  # the day of the build in progress in this process (None: none)


def dates_prompts(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template (any of its named ones) reads the clock."""
    template = getattr(tokenizer, "chat_template", None)
    texts = template.values() if isinstance(template, dict) else [template]
    return any(isinstance(text, str) and "strftime_now" in text for text in texts)


@contextlib.contextmanager
def rendered_as_of(day: dt.date | None) -> Iterator[None]:
    """Inside, every chat template's ``strftime_now`` reads ``day`` at 00:00 local time (None: the real clock).
    Not thread-safe: one build renders at a time per process (datasets.map workers enter it themselves)."""
    global _BUILD_DAY
    if day is None:
        yield
        return
    from transformers.utils import chat_template_utils

    moment = dt.datetime.combine(day, dt.time())

    class _Frozen(dt.datetime):
        @classmethod
        def now(cls, tz: dt.tzinfo | None = None) -> dt.datetime:
            return moment.replace(tzinfo=tz)

    saved = chat_template_utils.datetime, _BUILD_DAY
    chat_template_utils.datetime, _BUILD_DAY = _Frozen, day
    try:
        yield
    finally:
        chat_template_utils.datetime, _BUILD_DAY = saved


def today() -> dt.date:
    """The day a build starting now renders as of (one place for tests to set the clock)."""
    return dt.date.today()


def build_day() -> dt.date | None:
    """The day of the build in progress (inside :func:`rendered_as_of`), for the encoder to take to its workers."""
    return _BUILD_DAY
