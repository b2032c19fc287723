"""Where a completion ends (issue 32): a chat completion is the template's rendering of the assistant turn, with no
EOS after the template's own end of turn; plain text gets EOS. Tokenizers built offline whose EOS differs from
the end of turn (Gemma-style <eos> vs <end_of_turn>, ChatML with </s>, Llama 3 base's <|end_of_text|> vs
<|eot_id|>) and ones where the two agree (Qwen-style ChatML, Llama 3 instruct, Mistral)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import CORPUS, data_settings
from test_prepare import make_config
from test_tokenize import CONVERSATIONS, sentencepiece_tokenizer

from coati_kto.data.endings import (
    NO_EOS_WARNING,
    Endings,
    checkpoint_eos,
    completion_end_line,
    generation_eos_ids,
    template_end_of_turn,
)
from coati_kto.data.files import write_jsonl
from coati_kto.data.prepared import prepare
from coati_kto.data.tokenize import encode
from coati_kto.testing.tiny import build_tokenizer

# style -> (the template's end of turn, whether it is the tokenizer's EOS)
STYLES = {
    "gemma": ("<end_of_turn>", False),
    "chatml_s": ("<|im_end|>", False),
    "llama3_base": ("<|eot_id|>", False),
    "chatml": ("<|im_end|>", True),  # Qwen-style: EOS is the end of turn
    "llama3": ("<|eot_id|>", True),
    "mistral": ("</s>", True),
}


def tokenizer(style: str, eos_token: str | None = None):
    return build_tokenizer([*CORPUS, "[INST] user model [/INST]"] * 2, 400, style=style, eos_token=eos_token)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["one-turn", "two-turns"])
def test_stored_ids_are_the_template_rendering_of_the_whole_conversation(style: str, conversation) -> None:
    """Before: "...<end_of_turn>\\n<eos>", "...<|im_end|>\\n</s>", "...<|eot_id|><|end_of_text|>": a token the
    template never renders after every completion."""
    tok = tokenizer(style)
    end_of_turn, agrees = STYLES[style]
    p_ids, c_ids = encode(tok, conversation[:-1], conversation[-1:], True)
    whole = tok.apply_chat_template(conversation, tokenize=False)
    assert p_ids + c_ids == tok(whole, add_special_tokens=False)["input_ids"]
    assert tok.decode(c_ids).rstrip().endswith(conversation[-1]["content"].strip() + end_of_turn)
    assert (tok.eos_token_id in c_ids) == agrees
    assert template_end_of_turn(tok) == tok.convert_tokens_to_ids(end_of_turn)


def test_a_sentencepiece_gemma_tokenizer_gets_no_eos_after_end_of_turn() -> None:
    tok = sentencepiece_tokenizer("metaspace-first")  # Metaspace, Gemma's template and specials
    conversation = CONVERSATIONS[1]
    p_ids, c_ids = encode(tok, conversation[:-1], conversation[-1:], True)
    whole = tok.apply_chat_template(conversation, tokenize=False)
    assert p_ids + c_ids == tok(whole, add_special_tokens=False)["input_ids"]
    assert tok.eos_token_id not in c_ids and tok.decode(c_ids[-2:]) == "<end_of_turn>\n"


@pytest.mark.parametrize("style", STYLES)
def test_plain_text_completions_keep_eos(style: str) -> None:
    tok = tokenizer(style)
    p_ids, c_ids = encode(tok, "The capital of France is", " Paris.", False)
    assert c_ids[-1] == tok.eos_token_id and c_ids.count(tok.eos_token_id) == 1
    assert p_ids + c_ids[:-1] == tok("The capital of France is Paris.", add_special_tokens=False)["input_ids"]
    # A plain completion that already ends with the EOS text gets no second one.
    assert encode(tok, "Q:", " yes" + tok.eos_token, False)[1] == encode(tok, "Q:", " yes", False)[1]


@pytest.mark.parametrize("style", STYLES)
def test_plain_text_rendered_with_the_template_ends_as_messages_do(style: str) -> None:
    """A plain-text record written by rendering a conversation with the chat template (a common way to make KTO
    data) ends with the template's end of turn: it got EOS after it (Gemma's "<end_of_turn>\\n<eos>"), the token
    issue 32 removed from message records, because plain text looked at EOS alone."""
    tok = tokenizer(style)
    end_of_turn, agrees = STYLES[style]
    conversation = CONVERSATIONS[0]
    prompt = tok.apply_chat_template(conversation[:-1], tokenize=False, add_generation_prompt=True)
    whole = tok.apply_chat_template(conversation, tokenize=False)
    _, c_ids = encode(tok, prompt, whole[len(prompt) :], False)
    _, chat_ids = encode(tok, conversation[:-1], conversation[-1:], True)
    assert c_ids == chat_ids  # the same tokens as the conversation given as messages
    assert (tok.eos_token_id in c_ids) == agrees
    ids, how = Endings(tok).end(c_ids, chat=False)
    assert ids == c_ids and how == ("eos_given:plain" if agrees else f"stop:{end_of_turn}")


END_WITH_TEXT = (  # a template whose assistant turn ends in ordinary text, no special token
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\nThank you\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def test_a_turn_ending_in_text_gets_eos_unless_the_generation_config_stops_there(tmp_path: Path) -> None:
    tok = tokenizer("chatml_s")
    tok.chat_template = END_WITH_TEXT
    conversation = CONVERSATIONS[0]
    assert template_end_of_turn(tok) is None
    _, c_ids = encode(tok, conversation[:-1], conversation[-1:], True)
    assert c_ids[-1] == tok.eos_token_id  # nothing in the turn stops generation: the model learns to stop
    last = Endings(tok).last_token(c_ids[:-1])
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_token_id, last]}))
    config = make_config(tmp_path, tmp_path, ["x.jsonl"])
    assert generation_eos_ids(config.model.path) == sorted([tok.eos_token_id, last])
    stop_ids = generation_eos_ids(config.model.path)
    _, stopped = encode(tok, conversation[:-1], conversation[-1:], True, stop_ids=stop_ids)
    assert stopped == c_ids[:-1]


def test_completion_end_line() -> None:
    assert (
        completion_end_line([{"stop:<end_of_turn>": 5}, {"stop:<end_of_turn>": 2}], "<eos>")
        == "completions end with the template's `<end_of_turn>`; no EOS added"
    )
    assert (
        completion_end_line([{"eos_added:plain": 3}], "</s>")
        == "EOS `</s>` appended to plain-text completions"
    )
    assert completion_end_line([{"eos_added:plain": 3, "eos_given:plain": 1}, {}], "</s>") == (
        "EOS `</s>` appended to plain-text completions (1 of 4 already ended with it)"
    )
    assert completion_end_line([{"stop:<|im_end|>": 4, "eos_added:chat": 1}], "</s>") == (
        "completions end with the template's `<|im_end|>`; no EOS added; EOS `</s>` appended to 1 chat "
        "completions (their template turn ends with no token that stops generation)"
    )
    # No EOS anywhere was a plain line, "completions end as given: the tokenizer has no EOS token": a warning now.
    assert completion_end_line([{"as_given:plain": 2}], None) == NO_EOS_WARNING
    assert NO_EOS_WARNING.startswith(
        "warning: completions end as given: neither the tokenizer nor model.path's"
    )
    # The checkpoint's EOS, for a tokenizer without one, is named in the keys: the line says which and from where.
    fallback = "@`</s>` (id 2, model.path's generation_config.json eos_token_id: the tokenizer has no EOS)"
    assert completion_end_line([{"eos_added:plain" + fallback: 3}], None) == (
        "EOS `</s>` (id 2, model.path's generation_config.json eos_token_id: the tokenizer has no EOS) appended to "
        "plain-text completions"
    )


def _write_model(out: Path, style: str) -> Path:
    from coati_kto.testing.tiny import build_llama

    tok = tokenizer(style)
    build_llama(tok, hidden_size=32, num_layers=1).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_prepare_says_how_completions_end(tmp_path: Path, capsys) -> None:
    model = _write_model(tmp_path / "model", "gemma")
    chat = [
        {"messages": [{"role": "user", "content": f"Add {i} and 3."}, {"role": "assistant", "content": "5"}],
            "label": i % 3 != 0}
        for i in range(12)
    ]  # fmt: skip
    plain = [{"prompt": f"Add {i} and 3.", "completion": " 5", "label": i % 3 != 0} for i in range(12)]
    lines = {}
    for name, rows in (("chat", chat), ("plain", plain)):
        data = write_jsonl(rows, tmp_path / name / "data.jsonl")
        out = prepare(*data_settings(make_config(tmp_path / name, model, [str(data)])))
        printed = capsys.readouterr().out
        lines[name] = out.stats["completion_end"]
        assert f"  {lines[name]}\n" in printed
        stats = json.loads((tmp_path / name / "prepared" / "stats.json").read_text())
        assert stats["completion_end"] == lines[name] and stats["version"] == 8
    assert lines == {
        "chat": "completions end with the template's `<end_of_turn>`; no EOS added",
        "plain": "EOS `<eos>` appended to plain-text completions",
    }


def test_a_tokenizer_without_eos_ends_plain_completions_with_the_checkpoint_eos(
    tmp_path: Path, tiny_model_dir: Path, capsys
) -> None:
    """A model dir without tokenizer_config.json (so no eos_token) printed "completions end as given: the tokenizer
    has no EOS token" and exited 0, though generation_config.json said eos_token_id 2: trained never to stop."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "tokenizer_config.json").unlink()
    assert checkpoint_eos(model) == (2, "generation_config.json")
    rows = [{"prompt": f"Add {i} and 3.", "completion": " 5", "label": i % 3 != 0} for i in range(12)]
    data = write_jsonl(rows, tmp_path / "data.jsonl")
    out = prepare(*data_settings(make_config(tmp_path, model, [str(data)])))
    line = (
        "EOS `<|im_end|>` (id 2, model.path's generation_config.json eos_token_id: the tokenizer has no EOS) "
        "appended to plain-text completions"
    )
    assert out.stats["completion_end"] == line and f"  {line}\n" in capsys.readouterr().out
    assert all(r["input_ids"][-1] == 2 for r in out.train)
    # config.json's eos_token_id, when generation_config.json has none.
    (model / "generation_config.json").unlink()
    assert checkpoint_eos(model) == (2, "config.json")
    # None anywhere: the completions end as given, said as a warning.
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "eos_token_id"}))
    assert checkpoint_eos(model) is None
    out = prepare(*data_settings(make_config(tmp_path / "none", model, [str(data)])))
    assert out.stats["completion_end"] == NO_EOS_WARNING
    assert f"  {NO_EOS_WARNING}\n" in capsys.readouterr().out


def test_a_stop_token_inside_a_completion_is_counted_and_said(tmp_path: Path, capsys) -> None:
    """Tokens after a completion's first stop token were trained though generation ends there, and nothing
    counted them: a control token written in the record's text ("...<|im_end|>\\n<|im_start|>user..." from a
    scraped chat log), or a completion of several assistant turns. Now prepare counts the rows
    (``stop_inside_completion`` in stats.json) and names the first in one warning line."""
    tok = tokenizer("chatml_s")  # ChatML with </s> as EOS: the template's <|im_end|> stops too
    user = {"role": "user", "content": "Add 2 and 3."}
    one = [{"role": "assistant", "content": "5"}]
    two = [*one, {"role": "assistant", "content": "Anything else?"}]
    injected = [{"role": "assistant", "content": "5<|im_end|>\n<|im_start|>user\nthanks"}]
    endings = Endings(tok)
    flags = {}
    for name, completion in (("one", one), ("two", two), ("injected", injected)):
        _, c_ids = encode(tok, [user], completion, True)
        flags[name] = endings.stops_early(c_ids)
    _, plain = encode(tok, "Q:", " yes", False)  # plain text: its appended EOS is its end
    assert flags == {"one": False, "two": True, "injected": True} and not endings.stops_early(plain)

    model = _write_model(tmp_path / "model", "chatml_s")
    rows = [{"prompt": [user], "completion": two if i == 3 else one, "label": i % 3 != 0} for i in range(12)]
    data = write_jsonl(rows, tmp_path / "data.jsonl")
    out = prepare(*data_settings(make_config(tmp_path, model, [str(data)])))
    assert out.stats["train"]["stop_inside_completion"] == {"rows": 1, "first": f"{data}:4"}
    printed = capsys.readouterr().out
    assert (
        f"warning: 1 completions hold a token that ends generation before their end (e.g. {data}:4)"
        in printed
    )
