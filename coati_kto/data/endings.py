"""Where a completion ends: the chat template's end of turn, or EOS appended (issue 32).

A chat completion (:meth:`Endings.end`; ``completion_end`` per row says how each ended) is exactly what the
template renders for the assistant turn, its end-of-turn token and the text after it included, with NO EOS
appended when its last non-whitespace token stops generation: the tokenizer's EOS, an id of the checkpoint's
``generation_config.json`` ``eos_token_id`` (:func:`generation_eos_ids`), or the template's own end of turn
(:func:`template_end_of_turn`: Gemma's ``<end_of_turn>``, ChatML's ``<|im_end|>``, Llama 3's ``<|eot_id|>``).
An EOS after it (Gemma's ``<end_of_turn>\\n<eos>``) is a token the template never renders and the base model
never saw there: every desirable completion would push it up, and since the KL pairs end with it too, z0 would
measure that token rather than the answers. A template turn that ends with no such token gets EOS, as does a
plain-text completion, unless its last non-whitespace token already is EOS (:func:`completion_end_line` says
which, in one line).

The template's end of turn is found once per tokenizer by rendering a one-turn probe conversation. Which ending
each row got is counted per split (stats.json's ``completion_end``) and said in one line by ``prepare`` and the
model card (:func:`completion_end_line`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase


def checkpoint_json(model_path: str | Path, name: str) -> dict[str, Any] | None:
    """``model_path``'s JSON file ``name`` as a dict: from the local directory, or for a Hub id (``org/name``) the
    copy in the hub cache, as the model loader reads it (huggingface_hub's ``try_to_load_from_cache``, revision
    main; no download). None where neither holds one, or it is not a JSON object."""
    path = Path(model_path).expanduser()
    if not path.exists():
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(str(model_path), name)
        except ValueError:  # not a Hub id's shape (a local path that is not there): nothing to read
            return None
        if not isinstance(cached, str):
            return None
        path = Path(cached)
    else:
        path = path / name
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def generation_eos_ids(model_path: str | Path) -> list[int]:
    """The ``eos_token_id`` ids (one or a list) of ``model_path``'s ``generation_config.json`` (``model.path``, a
    local directory or a Hub id read from the hub cache: :func:`checkpoint_json`), sorted; [] when it has none."""
    found = (checkpoint_json(model_path, "generation_config.json") or {}).get("eos_token_id")
    found = found if isinstance(found, list) else [found]
    return sorted({int(i) for i in found if isinstance(i, int) and not isinstance(i, bool)})


def checkpoint_eos(model_path: str | Path) -> tuple[int, str] | None:
    """(id, file) of the checkpoint's own EOS: the first ``eos_token_id`` of ``model_path``'s
    ``generation_config.json``, else of its ``config.json`` (a local directory, or a Hub id's copies in the hub
    cache: :func:`checkpoint_json`); None when neither names one. The EOS a tokenizer without one (no
    ``tokenizer_config.json``) ends completions with, so the model still learns to stop."""
    for name in ("generation_config.json", "config.json"):
        found = (checkpoint_json(model_path, name) or {}).get("eos_token_id")
        first = found[0] if isinstance(found, list) and found else found
        if isinstance(first, int) and not isinstance(first, bool):
            return first, name
    return None


PROBE_TURN = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


def template_end_of_turn(
    tokenizer: PreTrainedTokenizerBase, template_kwargs: dict[str, Any] | None = None
) -> int | None:
    """The id of the special token the chat template ends an assistant turn with (``<end_of_turn>``,
    ``<|im_end|>``, ``<|eot_id|>``): the last non-whitespace token of a rendered one-turn reply, when it is a
    special or added token; None without a template, or when the turn ends in ordinary text."""
    try:
        kwargs = template_kwargs or {}
        prompt = tokenizer.apply_chat_template(
            PROBE_TURN[:1], tokenize=False, add_generation_prompt=True, **kwargs
        )
        whole = tokenizer.apply_chat_template(PROBE_TURN, tokenize=False, **kwargs)
    except Exception:  # no template, or one that refuses the probe: no end-of-turn token known
        return None
    if not whole.startswith(prompt):
        return None
    ids = tokenizer(whole[len(prompt) :], add_special_tokens=False)["input_ids"]
    last = next((t for t in reversed(ids) if tokenizer.decode([t]).strip()), None)
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return int(last) if last is not None and last in special else None


NO_EOS = (  # why, as the model card states it (``outputs.model_card``)
    "neither the tokenizer nor model.path's generation_config.json or config.json gives an EOS token in the "
    "tokenizer's vocabulary, so the model is never trained to stop"
)
# prepare's line, and stats.json's since issue 32 (a card reads it from builds of any age)
NO_EOS_WARNING = (
    f"warning: completions end as given: {NO_EOS}; give the tokenizer an eos_token (tokenizer_config.json) or "
    "the checkpoint an eos_token_id"
)


def completion_end_line(splits: list[dict[str, int]], eos_token: str | None) -> str:
    """One line saying how completions end, from the ``completion_end`` counts of the prepared splits, e.g.
    "completions end with the template's `<end_of_turn>`; no EOS added". An EOS that is not the tokenizer's comes
    named in its keys (:meth:`Endings.end`); none at all is a ``warning:`` (first, so it shows)."""
    counts: dict[str, int] = {}
    for split in splits:
        for how, n in split.items():
            kind, _, eos = how.partition("@")  # "eos_added:plain@`</s>` (id 2, ...)": the checkpoint's EOS
            counts[kind] = counts.get(kind, 0) + n
            eos_token = eos or eos_token
    if eos_token is not None and not eos_token.startswith("`"):
        eos_token = f"`{eos_token}`"
    parts = [NO_EOS_WARNING] if counts.get("as_given:chat") or counts.get("as_given:plain") else []
    stops = [k.removeprefix("stop:") for k in counts if k.startswith("stop:")]
    if stops:
        shown = " / ".join(f"`{t}`" for t in sorted(stops, key=lambda t: -counts["stop:" + t]))
        parts.append(f"completions end with the template's {shown}; no EOS added")
    if counts.get("eos_added:chat"):
        parts.append(
            f"EOS {eos_token} appended to {counts['eos_added:chat']} chat completions (their template turn "
            "ends with no token that stops generation)"
        )
    plain = counts.get("eos_added:plain", 0) + counts.get("eos_given:plain", 0)
    if plain:
        given = counts.get("eos_given:plain", 0)
        parts.append(
            f"EOS {eos_token} appended to plain-text completions"
            + (f" ({given} of {plain} already ended with it)" if given else "")
        )
    return "; ".join(parts)


class Endings:
    """Picklable (it runs in ``datasets.map`` workers): the stop ids of one tokenizer and how a completion ends.

    ``eos_fallback``: the checkpoint's EOS (:func:`checkpoint_eos`), used when the tokenizer has none (its
    ``tokenizer_config.json`` missing) and the id is in its vocabulary; ``end`` then names it in its keys."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        template_kwargs: dict[str, Any] | None = None,
        stop_ids: list[int] | tuple[int, ...] = (),
        eos_fallback: tuple[int, str] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_id
        self.named = ""  # "" for the tokenizer's EOS, else "@" and where the fallback came from
        if self.eos is None and eos_fallback is not None and 0 <= eos_fallback[0] < len(tokenizer):
            self.eos = eos_fallback[0]
            token = tokenizer.convert_ids_to_tokens(self.eos)
            self.named = f"@`{token}` (id {self.eos}, model.path's {eos_fallback[1]} eos_token_id: the tokenizer has no EOS)"
        self.end_of_turn = template_end_of_turn(tokenizer, template_kwargs)
        self.stops = {int(t) for t in (self.eos, self.end_of_turn, *stop_ids) if t is not None}
        self._blank: dict[int, bool] = {}

    def _is_blank(self, token: int) -> bool:
        if token not in self._blank:
            self._blank[token] = not self.tokenizer.decode([token]).strip()
        return self._blank[token]

    def stops_early(self, ids: list[int]) -> bool:
        """Whether a token that stops generation comes before the last token of ``ids`` that is not whitespace
        alone: the tokens after it are trained though generation never reaches them (a control token written in
        the record's text, or a completion of several assistant turns)."""
        return any(t in self.stops for t in ids[: self._last_index(ids)])

    def last_token(self, ids: list[int]) -> int | None:
        """The last token of ``ids`` that is not whitespace alone (None when there is none)."""
        last = self._last_index(ids)
        return ids[last] if last >= 0 else None

    def _last_index(self, ids: list[int]) -> int:
        """The index of the last token of ``ids`` that is not whitespace alone (-1 when there is none)."""
        return next((i for i in range(len(ids) - 1, -1, -1) if not self._is_blank(ids[i])), -1)

    def end(self, ids: list[int], chat: bool) -> tuple[list[int], str]:
        """(completion ids as stored, how they end: "stop:<token>" for a completion ending with a stop id (plain
        text: one that is not the EOS, e.g. text rendered with the template),
        "eos_added:chat|plain", "eos_given:plain" for plain text already ending with EOS, "as_given:chat|plain"
        for a tokenizer without EOS; the two EOS kinds followed by "@" and the EOS named when it is the
        checkpoint's, not the tokenizer's). Only "eos_added" appends a token."""
        kind, last = "chat" if chat else "plain", self.last_token(ids)
        # Plain text rendered with the chat template ends its turn as messages do: an EOS after Gemma's
        # `<end_of_turn>\n` is a token the model never saw there (docs/usage.md), whatever the record's format.
        if last in self.stops and (chat or last != self.eos):
            return ids, "stop:" + str(self.tokenizer.convert_ids_to_tokens(int(last)))
        if self.eos is None:
            return ids, f"as_given:{kind}"
        if not chat and last == self.eos:
            return ids, "eos_given:plain" + self.named
        return ids + [self.eos], f"eos_added:{kind}{self.named}"
