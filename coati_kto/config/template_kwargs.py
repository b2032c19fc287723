"""``data.chat_template_kwargs``: variables for the chat template, never ``apply_chat_template``'s own arguments.

Prepare calls ``apply_chat_template(conversation, tokenize=False, add_generation_prompt=...)`` for the prompt and
again for the whole conversation, then tokenizes and truncates the text itself. Given again through
``chat_template_kwargs``, one of its arguments made every call fail ("got multiple values for argument"), so every
chat record was a bad record (all skipped under ``data.on_bad_record: skip``); the rest were ignored in silence
(``return_dict``, ``max_length``, ``padding``) or broke the prompt/completion split (``continue_final_message``,
``chat_template``). ``tools`` and ``documents`` are template inputs and pass: a tool-use template renders
``tools`` for every record (a record's own ``tools`` replace them).

Nor the tokenizer's named special tokens (``bos_token``, ``eos_token``...): ``apply_chat_template`` gives the
template the tokenizer's own, and a variable of that name replaces it in the rendering only. ``bos_token: ""``
rendered no BOS, ``eos_token: "</s>"`` ended every turn with a text the tokenizer does not end with: the examples
and their loss masks differ from what the tokenizer and the model's generation use, in silence. A value equal to
the tokenizer's changes nothing, so none is needed: they are refused, one line each.
"""

from __future__ import annotations

from typing import Any

APPLY_ARGUMENTS = {
    "conversation": "the records' messages are the conversation",
    "messages": "the records' messages are the conversation",
    "add_generation_prompt": "prepare renders the prompt with it and the whole conversation without",
    "continue_final_message": "prepare splits prompt from completion at the assistant turn's start",
    "tokenize": "prepare renders text and tokenizes it itself",
    "return_dict": "prepare renders text and tokenizes it itself",
    "return_tensors": "prepare renders text and tokenizes it itself",
    "return_assistant_tokens_mask": "prepare masks the completion itself",
    "tokenizer_kwargs": "prepare renders text and tokenizes it itself",
    "padding": "the collator pads batches (data.pad_to_multiple_of)",
    "truncation": "prepare truncates examples itself (data.max_length, data.on_too_long)",
    "max_length": "prepare truncates examples itself (data.max_length, data.on_too_long)",
    "chat_template": "the template is the tokenizer's: set model.tokenizer to a tokenizer with the one wanted",
    # transformers 5 marks control tokens only while it tokenizes (it refuses tokenize=False): every record
    # failed ("requires tokenize=True"), blamed on record 1.
    "sanitize_control_tokens": "transformers sanitizes only while it tokenizes (it refuses tokenize=False) and "
    "prepare renders text (tokenize=False) to tokenize it itself, so every record would fail; a control token "
    "written in a record's text is read as that token, as by apply_chat_template's default (prepare warns of a "
    "stop token inside a completion)",
}

# transformers' SPECIAL_TOKENS_ATTRIBUTES (a test pins them): apply_chat_template passes the tokenizer's special
# tokens map to the template, and a template variable of the same name replaces the token in the rendering only.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def template_kwargs_problems(kwargs: dict[str, Any]) -> list[str]:
    """One line per key of ``data.chat_template_kwargs`` that is an argument of ``apply_chat_template`` prepare
    sets itself, or one of the tokenizer's named special tokens, naming it and why."""
    return [_problem(key) for key in kwargs if key in APPLY_ARGUMENTS or key in SPECIAL_TOKENS]


def _problem(key: str) -> str:
    """The line refusing ``key`` (one of :data:`APPLY_ARGUMENTS` or :data:`SPECIAL_TOKENS`)."""
    if key in APPLY_ARGUMENTS:
        return (
            f"data.chat_template_kwargs.{key}: an argument of apply_chat_template, not a template variable: "
            f"{APPLY_ARGUMENTS[key]}; remove it"
        )
    return (
        f"data.chat_template_kwargs.{key}: the tokenizer's own special token, which apply_chat_template gives the "
        "template itself: a value here replaces it in the rendered text only, so the examples and their loss "
        "masks no longer match the tokenizer (nor the EOS the model learns to stop with); remove it (for other "
        "special tokens, set model.tokenizer to a tokenizer that has them)"
    )
