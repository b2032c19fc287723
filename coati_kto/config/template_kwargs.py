"""``data.chat_template_kwargs``: variables for the chat template, never ``apply_chat_template``'s own arguments.

Prepare calls ``apply_chat_template(conversation, tokenize=False, add_generation_prompt=...)`` for the prompt and
again for the whole conversation, then tokenizes and truncates the text itself. Given again through
``chat_template_kwargs``, one of its arguments made every call fail ("got multiple values for argument"), so every
chat record was a bad record (all skipped under ``data.on_bad_record: skip``); the rest were ignored in silence
(``return_dict``, ``max_length``, ``padding``) or broke the prompt/completion split (``continue_final_message``,
``chat_template``). ``tools`` and ``documents`` are template inputs and pass: a tool-use template renders
``tools`` for every record (a record's own ``tools`` replace them).
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
    "sanitize_control_tokens": "prepare renders text and tokenizes it itself, which transformers does not "
    "sanitize; control tokens written in a record's text are read as control tokens, as apply_chat_template's "
    "default reads them",
}


def template_kwargs_problems(kwargs: dict[str, Any]) -> list[str]:
    """One line per key of ``data.chat_template_kwargs`` that is an argument of ``apply_chat_template`` prepare
    sets itself, naming it and why."""
    return [
        f"data.chat_template_kwargs.{key}: an argument of apply_chat_template, not a template variable: "
        f"{APPLY_ARGUMENTS[key]}; remove it"
        for key in kwargs
        if key in APPLY_ARGUMENTS
    ]
