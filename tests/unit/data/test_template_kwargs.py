"""data.chat_template_kwargs holds chat template variables. Before, apply_chat_template's own arguments were
accepted: ``tokenize``/``add_generation_prompt``/``conversation`` made every chat record fail ("got multiple values
for argument"), all skipped under on_bad_record: skip; ``return_dict``/``max_length``/``padding`` were ignored in
silence. They are refused at config load, one line each naming the key. ``tools`` is a template input: a tool-use
template renders it for every record (a record's own tools replace it)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import CORPUS, MINIMAL, data_settings, write_config
from test_prepare import make_config
from transformers import PreTrainedTokenizerBase

from coati_kto.config import load_config
from coati_kto.config.template_kwargs import SPECIAL_TOKENS
from coati_kto.data.chat import render
from coati_kto.data.files import write_jsonl
from coati_kto.data.prepared import prepare
from coati_kto.errors import ConfigError
from coati_kto.testing.tiny import build_tokenizer

KWARGS = """\
  chat_template_kwargs:
    enable_thinking: false
    tokenize: false
    add_generation_prompt: true
    return_dict: true
"""


def test_apply_chat_template_arguments_are_refused_at_config_load(tmp_path: Path) -> None:
    text = MINIMAL.replace("  prepared_dir: prepared\n", "  prepared_dir: prepared\n" + KWARGS)
    path = write_config(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    lines = str(err.value).splitlines()
    assert [line.split(": ", 2)[1] for line in lines] == [
        "data.chat_template_kwargs.tokenize",
        "data.chat_template_kwargs.add_generation_prompt",
        "data.chat_template_kwargs.return_dict",
    ]
    assert lines[0].startswith(
        f"{path}:8: data.chat_template_kwargs.tokenize: an argument of apply_chat_template"
    )
    assert "enable_thinking" not in str(err.value)
    override = ["data.chat_template_kwargs={chat_template: x}"]
    with pytest.raises(ConfigError, match=r"data.chat_template_kwargs.chat_template: .*model.tokenizer"):
        load_config(write_config(tmp_path, MINIMAL), override)
    # transformers 5's sanitize_control_tokens requires tokenize=True: every record failed, blamed on record 1.
    # The line said only that prepare tokenizes "itself, which transformers does not sanitize": not why it fails.
    override = ["data.chat_template_kwargs={sanitize_control_tokens: true}"]
    with pytest.raises(ConfigError) as err:
        load_config(write_config(tmp_path, MINIMAL), override)
    (line,) = str(err.value).splitlines()
    assert line.startswith("override data.chat_template_kwargs={sanitize_control_tokens: true}: ")
    assert "data.chat_template_kwargs.sanitize_control_tokens: an argument of apply_chat_template" in line
    assert "(it refuses tokenize=False)" in line and "every record would fail" in line
    assert line.endswith("; remove it")
    variables = ["data.chat_template_kwargs={enable_thinking: false, documents: []}"]
    assert load_config(write_config(tmp_path, MINIMAL), variables).data.chat_template_kwargs == {
        "enable_thinking": False,
        "documents": [],
    }


def test_special_tokens_are_refused_at_config_load(tmp_path: Path) -> None:
    """apply_chat_template passes the tokenizer's special tokens to the template, a template variable of the same
    name replacing them: ``bos_token: ""`` rendered no BOS, and the tokenizer's own EOS was not what the turns
    ended with. Accepted before, in silence; refused now, one line each naming the key."""
    kwargs = "  chat_template_kwargs:\n    bos_token: ''\n    enable_thinking: false\n    eos_token: </s>\n"
    text = MINIMAL.replace("  prepared_dir: prepared\n", "  prepared_dir: prepared\n" + kwargs)
    path = write_config(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    lines = str(err.value).splitlines()
    assert [line.split(": ", 2)[:2] for line in lines] == [
        [f"{path}:7", "data.chat_template_kwargs.bos_token"],
        [f"{path}:9", "data.chat_template_kwargs.eos_token"],
    ]
    assert all("the tokenizer's own special token" in line and "remove it" in line for line in lines)
    assert "model.tokenizer" in lines[0]
    # The names apply_chat_template passes (its special_tokens_map's keys).
    assert set(SPECIAL_TOKENS) == set(PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES)


def test_special_token_variables_change_the_rendering() -> None:
    """Why they are refused: the template renders the variable, not the tokenizer's token."""
    tok = build_tokenizer(CORPUS * 2, 300)
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    turns = ([{"role": "user", "content": "hi"}], [{"role": "assistant", "content": "yo"}])
    assert render(tok, *turns, True, "x") == ("<|im_start|>user: hi<|im_end|>\nassistant: ", "yo<|im_end|>\n")
    changed = render(tok, *turns, True, "x", None, {"bos_token": "", "eos_token": "</s>"})
    assert changed == ("user: hi</s>\nassistant: ", "yo</s>\n")


TOOL_TEMPLATE = (  # ChatML with Qwen-style tools in a system turn
    "{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t['function']['name'] }} {% endfor %}"
    "<|im_end|>\n{% endif %}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)


def tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {}}}


def test_tools_in_chat_template_kwargs_reach_every_prompt(tmp_path: Path, tiny_model_dir: Path) -> None:
    tok = build_tokenizer([*CORPUS, "Tools: search add"] * 2, 400)
    tok.chat_template = TOOL_TEMPLATE
    tok.save_pretrained(tmp_path / "tok")
    records = [
        {
            "messages": [
                {"role": "user", "content": f"What is the capital of France? ({i})"},
                {"role": "assistant", "content": "Paris." if i % 2 else "I cannot help with that."},
            ],
            "label": bool(i % 2),
            **({"tools": [tool("add")]} if i == 0 else {}),
        }
        for i in range(6)
    ]
    data = write_jsonl(records, tmp_path / "t.jsonl")
    config = make_config(
        tmp_path, tiny_model_dir, [str(data)], chat_template_kwargs={"tools": [tool("search")]}
    )
    config.model.tokenizer = str(tmp_path / "tok")
    train = prepare(*data_settings(config)).train
    prompts = {int(r["index"]): tok.decode(r["input_ids"][: r["completion_start"]]) for r in train.to_list()}
    assert len(prompts) == 6
    shown = sorted(p.split("\n")[1] for p in prompts.values())
    assert shown == [
        "Tools: add <|im_end|>",
        *["Tools: search <|im_end|>"] * 5,
    ]  # the record's own tools replace the default
