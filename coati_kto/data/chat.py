"""Chat records -> (prompt text, completion text) through the tokenizer's own chat template.

The prompt is ``template(prompt, add_generation_prompt=True)``; the completion text is what ``template(prompt +
completion)`` adds after it. Every call gets ``data.chat_template_kwargs`` (e.g. Qwen3's ``enable_thinking``)
and the record's own ``tools``. A template that fails on a record, renders a prompt that is not a prefix of the
whole conversation, or leaves out a system or user turn, the record's tools or part of a completion turn, makes
that record a one-line :class:`RecordError` (never a silent loss of what the model should see). A tokenizer
with no template at all, for records that need one, is one ConfigError before any is rendered
(:func:`require_chat_template`): every record would fail alike, and skipped, leave nothing to train on.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedTokenizerBase

from coati_kto.data.formats import Record, RecordError
from coati_kto.errors import ConfigError

if TYPE_CHECKING:
    from coati_kto.config.schema import ModelSection


def require_chat_template(
    tokenizer: PreTrainedTokenizerBase, records: list[Record], model: ModelSection
) -> None:
    """Raise ConfigError when a record is conversational (only those go through the template; plain text is used
    as given) and the tokenizer has no chat template, naming the tokenizer's key and how to give it one."""
    chat = next((r for r in records if r.chat), None)
    if chat is None or getattr(tokenizer, "chat_template", None):
        return
    key, name = ("model.tokenizer", model.tokenizer) if model.tokenizer else ("model.path", model.path)
    raise ConfigError(
        f"{key} {name}: its tokenizer has no chat template; conversational records need one ({chat.source} is "
        f"one): put the model's chat_template.jinja (or a chat_template entry in tokenizer_config.json) in {name}, "
        "set model.tokenizer to a tokenizer that has one, or give the records as plain prompt/completion strings"
    )


def render(
    tokenizer: PreTrainedTokenizerBase,
    prompt: Any,
    completion: Any,
    chat: bool,
    source: str,
    tools: list[dict] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[str, str]:
    """(prompt text, completion text); for chat records ``prompt text + completion text`` is the whole
    conversation as the template renders it (with ``tools`` and ``template_kwargs``, e.g. Qwen3's
    ``enable_thinking``). Raises RecordError when the template fails on this record."""
    if not chat:
        return prompt, completion
    out = render_chats(tokenizer, [prompt], [completion], [source], [tools], template_kwargs)[0]
    if isinstance(out, RecordError):
        raise out
    return out


def render_chats(
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list],
    completions: list[list],
    sources: list[str],
    tools: list[list[dict] | None] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[tuple[str, str] | RecordError]:
    """:func:`render` for many chat records at once, errors returned in place.

    One batched ``apply_chat_template`` call per set of records with the same tools (most batches: one): its
    per-call overhead costs as much as the rendering. A batch that fails is rendered record by record to name
    the records at fault.
    """
    tools = tools if tools is not None else [None] * len(prompts)
    groups: dict[str, list[int]] = {}
    for i, t in enumerate(tools):
        groups.setdefault(json.dumps(t, sort_keys=True), []).append(i)
    out: list[tuple[str, str] | RecordError] = [None] * len(prompts)  # type: ignore[list-item]
    for rows in groups.values():
        kwargs = {**(template_kwargs or {}), **({"tools": tools[rows[0]]} if tools[rows[0]] else {})}
        rendered = _render_group(
            tokenizer,
            [prompts[i] for i in rows],
            [completions[i] for i in rows],
            [sources[i] for i in rows],
            kwargs,
        )
        for i, r in zip(rows, rendered, strict=True):
            out[i] = r
    return out


def _render_group(
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list],
    completions: list[list],
    sources: list[str],
    kwargs: dict[str, Any],
) -> list[tuple[str, str] | RecordError]:
    """:func:`render_chats` for records that share ``kwargs`` (tools and template variables)."""
    try:
        prompt_texts = tokenizer.apply_chat_template(
            prompts, tokenize=False, add_generation_prompt=True, **kwargs
        )
        full_texts = tokenizer.apply_chat_template(
            [p + c for p, c in zip(prompts, completions, strict=True)], tokenize=False, **kwargs
        )
    except Exception as err:  # jinja raises on e.g. non-alternating roles; name the record, not the template
        if len(prompts) > 1:
            return [
                _render_group(tokenizer, [p], [c], [s], kwargs)[0]
                for p, c, s in zip(prompts, completions, sources, strict=True)
            ]
        msg = str(err).splitlines()[0] if str(err) else type(err).__name__
        return [RecordError(sources[0], "messages", f"the chat template failed: {msg}", "chat_template")]
    out: list[tuple[str, str] | RecordError] = []
    for prompt, completion, prompt_text, full_text, source in zip(
        prompts, completions, prompt_texts, full_texts, sources, strict=True
    ):

        def render(messages: list[dict]) -> str:
            return tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **kwargs
            )

        if (left_out := _left_out(prompt, prompt_text, kwargs.get("tools"), render)) is not None:
            out.append(RecordError(source, left_out[0], left_out[1], "not_rendered"))
            continue
        if full_text.startswith(prompt_text):
            completion_text = full_text[len(prompt_text) :]
            if (dropped := _completion_left_out(completion, completion_text)) is not None:
                out.append(RecordError(source, dropped[0], dropped[1], "not_rendered"))
            else:
                out.append((prompt_text, completion_text))
            continue
        at = next(
            (i for i, (a, b) in enumerate(zip(prompt_text, full_text, strict=False)) if a != b),
            len(full_text),
        )
        problem = (
            "the chat template renders the prompt (add_generation_prompt=True) as something that is not a "
            f"prefix of the whole conversation, so the completion cannot be located: at character {at} the "
            f"prompt has {prompt_text[at : at + 40]!r}, the conversation {full_text[at : at + 40]!r} (the "
            "template changes earlier turns once the conversation ends with an assistant turn)"
        )
        out.append(RecordError(source, "messages", problem, "chat_template"))
    return out


# Turns a template may rightly rewrite: assistant turns (reasoning stripped from history), tool results (as JSON;
# "ipython" is Llama 3.1's tool role, "function" the older OpenAI one).
REWRITTEN_ROLES = ("assistant", "tool", "ipython", "function")


def _left_out(
    prompt: list[dict],
    prompt_text: str,
    tools: list[dict] | None,
    render: Callable[[list[dict]], str] | None = None,
) -> tuple[str, str] | None:
    """(field, problem) when the template left out part of the prompt: a system, user or other turn (OpenAI's
    "developer") whose text is not in the rendering (a template without system turns drops them, one that knows
    only its own roles drops the rest), or tools none of whose names appear (a template without tool support
    ignores ``tools``). Assistant and tool turns are not checked: templates rightly rewrite them (reasoning
    stripped from history, tool results as JSON)."""
    for i, message in enumerate(prompt):
        content = message.get("content")
        shown = not isinstance(content, str) or content.strip() in prompt_text or _rendered(prompt, i, render)
        if message.get("role") not in REWRITTEN_ROLES and not shown:
            return f"prompt[{i}].content", (
                f"the chat template leaves this {message['role']} turn out of the prompt it renders, so the "
                "model would train without it; use a template that renders it, or remove the turn"
            )
    # An agent trace's actions: a template without tool support drops them.
    for i, message in enumerate(prompt):
        if missing := _calls_left_out(message, prompt_text):
            return f"prompt[{i}].tool_calls", (
                f"the chat template leaves this turn's tool calls ({missing}) out of the prompt it renders, so the "
                "model would train without them; use a template that renders tool_calls, or remove them"
            )
    names = _function_names(tools)
    if names and not any(name and name in prompt_text for name in names):
        return "tools", (
            f"the chat template renders none of the record's tools ({', '.join(names)[:80]}): it ignores tools, "
            "so the model would train without them; use a template with tool support, or drop the tools"
        )
    return None


def _calls_left_out(message: dict, text: str) -> str:
    """The names of ``message``'s tool calls (OpenAI's ``tool_calls``) that ``text`` does not hold, comma-joined
    and clipped; '' when every one shows (a template renders a call with its function's name)."""
    return ", ".join(n for n in _function_names(message.get("tool_calls")) if n and n not in text)[:80]


def _function_names(items: list | None) -> list[str]:
    """The function names of OpenAI-style tool definitions or tool calls (``{"function": {"name": ...}}`` or
    ``{"name": ...}``); '' for one without a name."""
    return [str((i.get("function") or i).get("name", "")) for i in items or [] if isinstance(i, dict)]


# Texts no template rewrites: they mark where a turn's content went (_rendered).
_PROBES = ("\u2063coati-kto-probe-start\u2063", "\u2063coati-kto-probe-end\u2063")


def _rendered(prompt: list[dict], i: int, render: Callable[[list[dict]], str] | None) -> bool:
    """Whether the template renders turn ``i`` whole, though not verbatim: with a probe on either side of its
    content, both show in the rendering. SmolLM3's takes the ``/think`` and ``/no_think`` flags its model card puts
    in the system prompt out of it (a system turn left out, and one cut short, still fail)."""
    if render is None:
        return False
    message = prompt[i]
    start, end = _PROBES
    probed = [*prompt[:i], {**message, "content": start + message["content"] + end}, *prompt[i + 1 :]]
    try:
        text = render(probed)
    except Exception:  # the template refuses the probe: keep the verbatim test's answer
        return False
    return start in text and end in text[text.index(start) :]


def _completion_left_out(completion: list[dict], completion_text: str) -> tuple[str, str] | None:
    """(field, problem) when the rendered completion lacks part of a completion turn's text, whitespace aside
    (templates trim turns and lay out reasoning in their own lines): a template that strips ``<think>...</think>``
    from every assistant turn, the last included (DeepSeek-R1's as first released), or drops the final turn,
    would otherwise train on the rest in silence (on EOS alone for a dropped turn)."""
    rendered = "".join(completion_text.split())
    for i, message in enumerate(completion):
        if missing := _calls_left_out(message, completion_text):  # a call-only turn rendered as its end alone
            return f"completion[{i}].tool_calls", (
                f"the chat template leaves this assistant turn's tool calls ({missing}) out of the completion it "
                "renders, so the model would not train on them; use a template that renders tool_calls, or "
                "remove them"
            )
        content = message.get("content")
        if isinstance(content, str) and "".join(content.split()) not in rendered:
            return f"completion[{i}].content", (
                "the chat template leaves part of this assistant turn out of the completion it renders (e.g. "
                "reasoning between <think> and </think>), so the model would not train on it; use a template "
                "that renders it, or remove that part from the record"
            )
        # The label judged the reasoning too: without it the answer alone would be trained, in silence.
        for key in REASONING_KEYS:
            text = message.get(key)
            if isinstance(text, str) and "".join(text.split()) not in rendered:
                return f"completion[{i}].{key}", (
                    f"the chat template does not render this assistant turn's {key}, so the model would not "
                    f"train on it (the answer alone would carry the label); use a template that renders {key} "
                    "(Qwen3's renders reasoning_content), or move it into content, or remove it"
                )
    return None


# The keys reasoning is given under in an assistant turn: vLLM's and DeepSeek's reasoning_content, OpenAI's
# reasoning, and thinking (Anthropic's block name, used by some chat datasets).
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
