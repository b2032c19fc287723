"""Tokenization: one token sequence per conversation whatever its shape, exact completion split, counted cuts."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_data_formats import CONVERSATION, conversation_shapes
from tokenizers.processors import TemplateProcessing

from coati_kto.data.formats import RecordError, normalize
from coati_kto.data.tokenize import bos_prefix, encode, join_truncated, render, truncation

INT_LISTS = pa.list_(pa.int32())


def test_every_shape_gives_the_same_tokens(tiny_tokenizer) -> None:
    shapes = conversation_shapes()
    encoded = {}
    for name, raw in shapes.items():
        (record,) = normalize(raw, name)
        encoded[name] = encode(tiny_tokenizer, record.prompt, record.completion, record.chat)
    # A preference pair's chosen side, and plain strings holding the rendered text, give the same tokens too.
    chosen, _ = normalize({"chosen": CONVERSATION, "rejected": CONVERSATION}, "pair")
    encoded["pair"] = encode(tiny_tokenizer, chosen.prompt, chosen.completion, chosen.chat)
    prompt_text, completion_text = render(tiny_tokenizer, CONVERSATION[:2], CONVERSATION[2:], True, "x")
    encoded["plain"] = encode(tiny_tokenizer, prompt_text, completion_text, False)
    first = encoded["messages"]
    assert all(v == first for v in encoded.values()), {k: v for k, v in encoded.items() if v != first}

    # The whole sequence is the template's rendering of the conversation, split at the assistant turn.
    full = tiny_tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert tiny_tokenizer.decode(first[0] + first[1]) == full
    assert tiny_tokenizer.decode(first[1]) == CONVERSATION[2]["content"] + "<|im_end|>\n"
    assert first[1].count(tiny_tokenizer.eos_token_id) == 1  # the template's end of turn, no second EOS


@pytest.mark.parametrize(
    ("prompt", "completion"),
    [("Answer: ", "5"), ("ca", "pital"), ("The answer is", " 5"), ("def add(a, b):\n   ", " return a + b")],
)
def test_plain_split_is_exact_even_when_bpe_merges_the_boundary(tiny_tokenizer, prompt: str, completion: str):
    p_ids, c_ids = encode(tiny_tokenizer, prompt, completion, False)
    assert tiny_tokenizer.decode(p_ids) == prompt
    assert tiny_tokenizer.decode(c_ids) == completion + tiny_tokenizer.eos_token
    assert c_ids[-1] == tiny_tokenizer.eos_token_id


def test_boundary_merge_cases_really_merge(tiny_tokenizer) -> None:
    """Guard for the test above: taking full[len(prompt):] would shift the mask on these inputs."""
    for prompt, completion in [("Answer: ", "5"), ("ca", "pital")]:
        full = tiny_tokenizer(prompt + completion, add_special_tokens=False)["input_ids"]
        alone = tiny_tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert full[: len(alone)] != alone
        assert tiny_tokenizer.decode(full[len(alone) :]) != completion


def test_eos_appended_once(tiny_tokenizer) -> None:
    eos = tiny_tokenizer.eos_token
    _, ended = encode(tiny_tokenizer, "Q:", " yes" + eos, False)
    _, ended_ws = encode(tiny_tokenizer, "Q:", " yes" + eos + "\n", False)
    _, open_ = encode(tiny_tokenizer, "Q:", " yes", False)
    assert ended == open_ and ended.count(tiny_tokenizer.eos_token_id) == 1
    assert tiny_tokenizer.decode(ended_ws) == " yes" + eos + "\n"


def test_bos_prefix_for_tokenizers_that_add_bos(tiny_tokenizer) -> None:
    from copy import deepcopy

    tok = deepcopy(tiny_tokenizer)
    bos = tok.convert_tokens_to_ids("<|im_start|>")
    assert bos_prefix(tok) == []
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)]
    )
    assert bos_prefix(tok) == [bos]
    p_ids, _ = encode(tok, "Q:", " yes", False)
    assert p_ids[0] == bos and p_ids.count(bos) == 1
    chat_p, _ = encode(tok, CONVERSATION[:2], CONVERSATION[2:], True)
    assert chat_p.count(bos) == 3  # the template's own <|im_start|> (3 turns), nothing prepended


def test_template_failure_is_a_record_error(tiny_tokenizer) -> None:
    from copy import deepcopy

    tok = deepcopy(tiny_tokenizer)
    tok.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}x"
    )
    with pytest.raises(
        RecordError, match=r"^f.jsonl:7: field 'messages': the chat template failed: no system role"
    ):
        encode(tok, CONVERSATION[:2], CONVERSATION[2:], True, source="f.jsonl:7")


def test_truncation_rules() -> None:
    p, c = np.array([10, 30, 30, 5, 50]), np.array([10, 10, 40, 60, 1])
    keep_p, keep_c = truncation(p, c, max_length=40, max_prompt_length=20)
    # fits | fits exactly | prompt 20 + completion 20 | short prompt, completion gets the rest | prompt cut
    assert keep_p.tolist() == [10, 30, 20, 5, 20]
    assert keep_c.tolist() == [10, 10, 20, 35, 1]
    assert ((keep_p + keep_c) <= 40).all()
    # No room for a completion at all (a config the schema forbids, handled anyway): keep 0 -> dropped.
    assert truncation(50, 5, max_length=40, max_prompt_length=40)[1] == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), st.integers(1, 12)), min_size=1, max_size=20), st.data())
def test_join_truncated_matches_python(lengths, data) -> None:
    rng = np.random.default_rng(len(lengths))
    prompts = [rng.integers(0, 100, p).tolist() for p, _ in lengths]
    comps = [rng.integers(100, 200, c).tolist() for _, c in lengths]
    n = len(lengths)
    rows = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=n, max_size=n)))
    keep_p = np.array([data.draw(st.integers(0, len(p))) for p in prompts])
    keep_c = np.array([data.draw(st.integers(0, len(comps[j]))) for j in rows])
    out = join_truncated(
        pa.array(prompts, INT_LISTS), pa.array(comps, INT_LISTS), rows, keep_p, keep_c
    ).to_pylist()
    expected = [prompts[i][len(prompts[i]) - keep_p[i] :] + comps[j][: keep_c[i]] for i, j in enumerate(rows)]
    assert out == expected
