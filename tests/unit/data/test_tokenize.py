"""Tokenization: one token sequence per conversation whatever its shape, exact completion split, counted cuts."""

from __future__ import annotations

import functools
import string
from pathlib import Path

import numpy as np
import pytest
from helpers import CORPUS
from hypothesis import given, settings
from hypothesis import strategies as st
from test_data_formats import CONVERSATION, conversation_shapes
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers.processors import TemplateProcessing
from transformers import PreTrainedTokenizerFast

from coati_kto.data.chat import render
from coati_kto.data.formats import RecordError, normalize
from coati_kto.data.tokenize import Encoder, bos_prefix, encode, truncation
from coati_kto.data.vocabulary import pad_id


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
    ("prompt", "completion", "stored_prompt", "stored_completion"),
    [
        ("Answer: ", "5", "Answer:", " 5"),  # " 5" straddles the boundary: it goes to the completion
        ("ca", "pital", "c", "apital"),
        ("The answer is", " 5", "The answer is", " 5"),
        ("def add(a, b):\n   ", " return a + b", "def add(a, b):\n   ", " return a + b"),
    ],
)
def test_a_token_straddling_the_boundary_belongs_to_the_completion(
    tiny_tokenizer, prompt: str, completion: str, stored_prompt: str, stored_completion: str
) -> None:
    p_ids, c_ids = encode(tiny_tokenizer, prompt, completion, False)
    whole = tiny_tokenizer(prompt + completion, add_special_tokens=False)["input_ids"]
    assert p_ids + c_ids == whole + [tiny_tokenizer.eos_token_id]  # the whole text, tokenized once
    assert tiny_tokenizer.decode(p_ids) == stored_prompt
    assert tiny_tokenizer.decode(c_ids) == stored_completion + tiny_tokenizer.eos_token
    inside = Encoder(tiny_tokenizer).split([prompt], [completion])[2]
    assert inside == [stored_prompt != prompt]


def test_a_straddling_token_holding_only_completion_whitespace_stays_with_the_prompt(tiny_tokenizer) -> None:
    """Phi-3's role tokens strip the whitespace after them (AddedToken rstrip): with a completion starting with a
    space or newline, "<|assistant|>" straddled the boundary and was trained on as the completion's first token
    (the prompt lost it; KL pairs got 0 or 2 of it). It stays with the prompt; the straddle is still counted."""
    from copy import deepcopy

    from tokenizers import AddedToken

    tok = deepcopy(tiny_tokenizer)
    tok.add_special_tokens(
        {"additional_special_tokens": [AddedToken("<|assistant|>", rstrip=True, special=True)]}
    )
    role = tok.convert_tokens_to_ids("<|assistant|>")
    clean = Encoder(tok).split(["Q?<|assistant|>\n"], ["Paris."])
    for completion in (" Paris.", "\n Paris.", "\nParis."):
        (p_ids,), (c_ids,), (inside,) = Encoder(tok).split(["Q?<|assistant|>\n"], [completion])
        assert p_ids[-1] == role and role not in c_ids and inside
        assert p_ids + c_ids == tok("Q?<|assistant|>\n" + completion, add_special_tokens=False)["input_ids"]
        assert tok.decode(c_ids).strip() == "Paris." and p_ids == clean[0][0]
    assert clean[2] == [False]


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
    # A plain prompt already rendered with its BOS (a template applied by the user) gets no second one.
    rendered, _ = encode(tok, "<|im_start|>Q:", " yes", False)
    assert rendered == p_ids


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


# ---------------------------------------------------------------- SentencePiece-style tokenizers, built offline

GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n{{ message['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
LLAMA2_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + message['content'] "
    "+ ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)
SENTENCEPIECE_STYLES = ("metaspace-first", "metaspace-always", "legacy-prepend")


@functools.cache
def sentencepiece_tokenizer(style: str) -> PreTrainedTokenizerFast:
    """A BPE over "▁"-words as SentencePiece models convert to ``tokenizers``, in one of SENTENCEPIECE_STYLES:

    * ``metaspace-first``: Gemma-like (Metaspace pre-tokenizer, prepend_scheme "first"; Gemma's turn template,
      a pad token);
    * ``metaspace-always``: Mistral v0.x-like (prepend_scheme "always": "▁" after every special token too);
    * ``legacy-prepend``: Llama-2's tokenizer.json (normalizer Prepend("▁") + Replace(" ", "▁"), no
      pre-tokenizer; [INST] template, no pad token).

    The last two put "▁" before any text tokenized on its own, the first before the start of any text. Each adds
    BOS to plain text (a TemplateProcessing post-processor, as Llama's and Gemma's do).
    """
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    if style == "legacy-prepend":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            prepend_scheme="never"
        )  # training only: merges within words
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    else:
        scheme = "first" if style == "metaspace-first" else "always"
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme)
        tok.decoder = decoders.Metaspace(prepend_scheme=scheme)
    gemma = style == "metaspace-first"
    specials = (
        ["<unk>", "<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"]
        if gemma
        else ["<unk>", "<s>", "</s>"]
    )
    alphabet = sorted(set(string.ascii_letters + string.digits + string.punctuation + "▁\n"))
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator([*CORPUS, *["[INST] user model [/INST]"] * 5], trainer=trainer)
    if style == "legacy-prepend":
        tok.pre_tokenizer = None
    bos = specials[1]
    tok.post_processor = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=specials[2],
        unk_token="<unk>",
        pad_token="<pad>" if gemma else None,
        chat_template=GEMMA_TEMPLATE if gemma else LLAMA2_TEMPLATE,
    )


def any_tokenizer(style: str, tiny_tokenizer: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    return tiny_tokenizer if style == "byte-level" else sentencepiece_tokenizer(style)


ALL_STYLES = ("byte-level", *SENTENCEPIECE_STYLES)
USER = {"role": "user", "content": "What is the capital of France?"}
CONVERSATIONS = [
    [USER, {"role": "assistant", "content": "Paris is the capital."}],
    [USER, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Italy?"},
     {"role": "assistant", "content": " Rome, with a space first."}],
]  # fmt: skip


@pytest.mark.parametrize("style", ALL_STYLES)
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["one-turn", "two-turns"])
def test_chat_ids_are_the_whole_conversation_tokenized_once(tiny_tokenizer, style: str, conversation) -> None:
    """Issue 17: tokenizing the completion alone gave SentencePiece-style tokenizers a "▁" on every completion."""
    tok = any_tokenizer(style, tiny_tokenizer)
    text = tok.apply_chat_template(conversation, tokenize=False)
    p_ids, c_ids = encode(tok, conversation[:-1], conversation[-1:], True)
    whole = tok(text, add_special_tokens=False)["input_ids"]
    # Exactly: every style's template ends the turn with a stop token (Gemma's <end_of_turn>, ChatML's
    # <|im_end|>, Llama-2's </s>), so no EOS follows it (issue 32: Gemma's rows ended "<end_of_turn>\n<eos>").
    assert p_ids + c_ids == whole
    if style in ("byte-level", "metaspace-first"):  # decoding is exact for these: the rendered text itself
        assert tok.decode(whole) == text
    # The completion's tokens are those after the rendered prompt, with nothing prepended to them.
    prompt_text = tok.apply_chat_template(conversation[:-1], tokenize=False, add_generation_prompt=True)
    assert p_ids == tok(prompt_text, add_special_tokens=False)["input_ids"][: len(p_ids)]


@pytest.mark.parametrize("style", ALL_STYLES)
@pytest.mark.parametrize(
    ("prompt", "completion"), [("The capital of France is", " Paris."), ("Q: 2+3=", "5"), ("Hi\n", "there")]
)
def test_plain_ids_are_the_whole_text_tokenized_once(
    tiny_tokenizer, style: str, prompt: str, completion: str
):
    tok = any_tokenizer(style, tiny_tokenizer)
    p_ids, c_ids = encode(tok, prompt, completion, False)
    assert p_ids + c_ids == tok(prompt + completion)["input_ids"] + [tok.eos_token_id]  # BOS included
    assert tok.decode(p_ids + c_ids, skip_special_tokens=True) == tok.decode(
        tok(prompt + completion)["input_ids"], skip_special_tokens=True
    )


TEXT = st.text(alphabet=string.ascii_letters[:8] + " \n.:", max_size=30)


@settings(max_examples=150, deadline=None)
@given(TEXT, TEXT.filter(str.strip), st.sampled_from(ALL_STYLES))
def test_split_invariants(tiny_tokenizer, prompt: str, completion: str, style: str) -> None:
    """Prompt ids + completion ids == tokenizer(whole text); prompt ids are whole tokens of the prompt text (plus
    completion whitespace a straddling token holds), the boundary is flagged exactly when a token straddles it."""
    tok = any_tokenizer(style, tiny_tokenizer)
    (p_ids,), (c_ids,), (inside,) = Encoder(tok).split([prompt], [completion])
    assert p_ids + c_ids == tok(prompt + completion, add_special_tokens=False)["input_ids"]
    if style == "byte-level":  # lossless decoding: the prompt ids spell a prefix of the prompt, or the prompt
        spelled = tok.decode(p_ids)  # and (a token holding only that of the completion) leading whitespace
        assert prompt.startswith(spelled) or (
            spelled.startswith(prompt) and not spelled[len(prompt) :].strip()
        )
        assert inside == (spelled != prompt)


def test_empty_prompt_without_bos_is_a_record_error(tiny_tokenizer) -> None:
    with pytest.raises(
        RecordError, match=r"^f.jsonl:4: field 'prompt': no prompt tokens \(the prompt is empty"
    ):
        encode(tiny_tokenizer, "", "hello", False, source="f.jsonl:4")
    tok = sentencepiece_tokenizer("metaspace-first")  # adds BOS: BOS predicts the first completion token
    p_ids, c_ids = encode(tok, "", "hello", False)
    assert p_ids == [tok.bos_token_id] and tok.decode(c_ids) == "hello<eos>"


def test_pad_id_falls_back_to_eos() -> None:
    assert pad_id(sentencepiece_tokenizer("metaspace-first")) == (
        sentencepiece_tokenizer("metaspace-first").pad_token_id,
        "",
    )
    tok = sentencepiece_tokenizer("legacy-prepend")
    assert tok.pad_token_id is None
    pad, note = pad_id(tok)
    assert pad == tok.eos_token_id
    assert note == (
        f"note: the tokenizer has no pad token; padding with EOS '</s>' (id {pad}), which is harmless: masks come "
        "from lengths"
    )


def test_python_tokenizers_split_like_fast_ones(tiny_tokenizer, tmp_path) -> None:
    """A slow (Python) tokenizer has no offsets: the common-prefix fallback gives the same split."""
    from transformers import GPT2Tokenizer

    vocab, merges = tiny_tokenizer.backend_tokenizer.model.save(str(tmp_path))
    slow = GPT2Tokenizer(vocab, merges, eos_token="<|im_end|>")
    if slow.is_fast:  # transformers 5: every GPT-2 tokenizer has the Rust backend (and so offsets)
        pytest.skip("this transformers has no Python GPT-2 tokenizer")
    prompts = ["Answer: ", "ca", "The answer is", "def add(a, b):\n   ", "x"]
    completions = ["5", "pital", " 5", " return a + b", " y"]
    assert Encoder(slow).split(prompts, completions) == Encoder(tiny_tokenizer).split(prompts, completions)
    assert Encoder(slow).split(prompts, completions)[2] == [True, True, False, False, False]


def test_a_template_that_leaves_out_a_turn_or_the_tools_makes_a_bad_record() -> None:
    """A template without system turns (the Mistral style here) or without tool support (this ChatML one)
    rendered the record without them, and the model trained on less than the record said, in silence."""
    from coati_kto.data.chat import render
    from coati_kto.testing.tiny import build_tokenizer

    corpus = ["The rules are strict.", "What is the weather?", "Sunny."]
    system = {"role": "system", "content": "The rules are strict."}
    user = {"role": "user", "content": "What is the weather?"}
    completion = [{"role": "assistant", "content": "Sunny."}]
    mistral = build_tokenizer(corpus, vocab_size=300, style="mistral")
    with pytest.raises(RecordError) as info:
        render(mistral, [system, user], completion, True, "d.jsonl:3")
    assert str(info.value) == (
        "d.jsonl:3: field 'prompt[0].content': the chat template leaves this system turn out of the prompt it "
        "renders, so the model would train without it; use a template that renders it, or remove the turn"
    )
    assert info.value.reason == "not_rendered"
    assert render(mistral, [user], completion, True, "d.jsonl:3")[1] == "Sunny.</s>"
    chatml = build_tokenizer(corpus, vocab_size=300, style="chatml")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    with pytest.raises(
        RecordError, match=r"field 'tools': the chat template renders none of the record's tools"
    ):
        render(chatml, [system, user], completion, True, "d.jsonl:3", tools=tools)
    prompt, _ = render(chatml, [system, user], completion, True, "d.jsonl:3")
    assert "The rules are strict." in prompt


def test_a_template_that_leaves_out_tool_calls_makes_a_bad_record() -> None:
    """A template without tool support rendered a call-only completion as its end of turn alone (every label's
    completion the same tokens) and an agent trace's earlier calls as empty turns, in silence."""
    from coati_kto.data.chat import render
    from coati_kto.testing.tiny import build_tokenizer

    user = {"role": "user", "content": "What is the weather in Paris?"}
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    acting = [{"role": "assistant", "content": "", "tool_calls": [call]}]
    chatml = build_tokenizer(["What is the weather in Paris?", "Sunny."], vocab_size=300, style="chatml")
    with pytest.raises(RecordError) as info:
        render(chatml, [user], acting, True, "d.jsonl:2")
    assert str(info.value) == (
        "d.jsonl:2: field 'completion[0].tool_calls': the chat template leaves this assistant turn's tool calls "
        "(get_weather) out of the completion it renders, so the model would not train on them; use a template "
        "that renders tool_calls, or remove them"
    )
    assert info.value.reason == "not_rendered"
    trace = [user, *acting, {"role": "tool", "content": "Sunny."}]
    with pytest.raises(
        RecordError, match=r"^d.jsonl:2: field 'prompt\[1\].tool_calls': the chat template leaves"
    ):
        render(chatml, trace, [{"role": "assistant", "content": "Sunny."}], True, "d.jsonl:2")
    chatml.chat_template = (  # ChatML that renders calls, as tool-use templates do
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% for c in m.tool_calls or [] %}"
        "<tool_call>{{ c.function.name }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    assert (
        render(chatml, [user], acting, True, "d.jsonl:2")[1]
        == "<tool_call>get_weather</tool_call><|im_end|>\n"
    )
    render(chatml, trace, [{"role": "assistant", "content": "Sunny."}], True, "d.jsonl:2")


def test_a_pad_id_past_the_model_embeddings_is_passed_over(tmp_path) -> None:
    """A pad token added to the tokenizer, the model not resized (Mistral v0.1 + "[PAD]", id 32000 of 32000
    embeddings): the data held no such id, so prepare passed, and padding with it was an IndexError in the
    embedding at the first padded micro-batch (a device-side assert on a GPU)."""
    import json

    from coati_kto.families import vocabulary_size

    tok = sentencepiece_tokenizer("metaspace-first")
    pad, eos = tok.pad_token_id, tok.eos_token_id
    assert pad > eos
    assert pad_id(tok, vocab_size=pad + 1) == (pad, "")
    assert pad_id(tok) == (pad, "")
    assert pad_id(tok, vocab_size=pad) == (
        eos,
        f"note: the tokenizer's pad token '<pad>' (id {pad}) is past the model's {pad} token embeddings; padding "
        f"with id {eos} instead, which is harmless: masks come from lengths",
    )
    assert pad_id(tok, vocab_size=eos)[0] == 0
    # The model's rows from config.json; with a reference model, the fewer of the two.
    for name, vocab in (("policy", 394), ("reference", 300), ("vl", None)):
        (tmp_path / name).mkdir()
        raw = {"vocab_size": vocab} if vocab else {"text_config": {"vocab_size": 500}}
        (tmp_path / name / "config.json").write_text(json.dumps(raw))
    assert vocabulary_size(str(tmp_path / "policy"), None) == 394
    assert vocabulary_size(str(tmp_path / "policy"), str(tmp_path / "reference")) == 300
    assert vocabulary_size(str(tmp_path / "vl")) == 500
    assert vocabulary_size("some/hub-id", None) is None


def python_tokenizer(fast: PreTrainedTokenizerFast):
    """A Python (slow) tokenizer with ``fast``'s vocabulary, merges and added tokens, but no offsets: what
    remote-code tokenizers (Qwen-1's tiktoken, ChatGLM, Baichuan; ``model.trust_remote_code``) are, and what
    transformers 5 no longer builds for GPT-2 (test_python_tokenizers_split_like_fast_ones skips there)."""
    from transformers.tokenization_python import PythonBackend

    backend = fast.backend_tokenizer

    class PythonTokenizer(PythonBackend):
        def __init__(self, **kwargs) -> None:
            self._vocab = backend.get_vocab(with_added_tokens=False)
            self._tokens = {i: t for t, i in self._vocab.items()}
            super().__init__(**kwargs)

        def get_vocab(self) -> dict[str, int]:
            return {**self._vocab, **self.added_tokens_encoder}

        @property
        def vocab_size(self) -> int:
            return len(self._vocab)

        def _tokenize(self, text: str, **kwargs) -> list[str]:
            return backend.encode(text, add_special_tokens=False).tokens

        def _convert_token_to_id(self, token: str) -> int:
            return self._vocab[token]

        def _convert_id_to_token(self, index: int) -> str:
            return self._tokens[index]

        def convert_tokens_to_string(self, tokens: list[str]) -> str:
            return backend.decoder.decode(tokens)

    added = [fast.added_tokens_decoder[i] for i in sorted(fast.added_tokens_decoder)]
    slow = PythonTokenizer(eos_token=fast.eos_token, additional_special_tokens=added)
    assert not slow.is_fast and slow.get_vocab() == fast.get_vocab()
    return slow


def test_python_tokenizers_keep_completion_whitespace_tokens_with_the_prompt() -> None:
    """The common-prefix split of Python tokenizers put a straddling token holding only the completion's leading
    whitespace into the completion ("Sum:\n" + "\n\nThe...": the prompt's own newline, merged into "\n\n",
    trained on as model output and missing from the KL pairs' prompts), where the offsets split keeps it with
    the prompt."""
    from coati_kto.testing.tiny import build_tokenizer

    fast = build_tokenizer([*CORPUS, *["Sum:\n\n\nThe answer is 5.\n\n"] * 20], vocab_size=400)
    slow = python_tokenizer(fast)
    newlines = fast.convert_tokens_to_ids("ĊĊ")
    prompts = ["Sum:\n", "Sum:\n", "Sum:\n", "Answer: ", "ca", "x"]
    completions = ["\n\nThe answer is 5.", "\n\n\nThe answer is 5.", "The answer is 5.", "5", "pital", " y"]
    fast_split, slow_split = (
        Encoder(fast).split(prompts, completions),
        Encoder(slow).split(prompts, completions),
    )
    assert slow_split == fast_split
    assert [p[-1] for p in slow_split[0][:2]] == [
        newlines,
        newlines,
    ]  # "\n" of the prompt + "\n" of the completion
    assert [slow.decode(c) for c in slow_split[1][:3]] == [
        "\nThe answer is 5.",
        "\n\nThe answer is 5.",
        "The answer is 5.",
    ]
    assert slow_split[2] == [True, True, False, True, True, False]
    for p, c, prompt, completion in zip(*slow_split[:2], prompts, completions, strict=True):
        assert p + c == slow(prompt + completion, add_special_tokens=False)["input_ids"]


def test_a_template_that_leaves_out_part_of_the_completion_makes_a_bad_record(tiny_tokenizer) -> None:
    """DeepSeek-R1's template as first released strips <think>...</think> from every assistant turn, the last
    included, while its generation prompt stays a prefix: the reasoning was left out of the loss in silence (and a
    template that drops the final turn trained on EOS alone). Reformatted whitespace is not a loss."""
    from copy import deepcopy

    tok = deepcopy(tiny_tokenizer)
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% set content = m['content'] %}"
        "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
        "{{ content | trim }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    user = [{"role": "user", "content": "What is the capital of France?"}]
    reasoning = [{"role": "assistant", "content": "<think>It is Paris.</think>\n\nParis."}]
    with pytest.raises(RecordError) as info:
        encode(tok, user, reasoning, True, source="r1.jsonl:7")
    assert str(info.value) == (
        "r1.jsonl:7: field 'completion[0].content': the chat template leaves part of this assistant turn out of "
        "the completion it renders (e.g. reasoning between <think> and </think>), so the model would not train "
        "on it; use a template that renders it, or remove that part from the record"
    )
    assert info.value.reason == "not_rendered"
    # Trimmed, or whitespace laid out differently (Qwen3 puts reasoning on lines of its own): all of it is there.
    for content in ("  Paris.\n", "Paris,\n\n  then Rome."):
        _, c_ids = encode(tok, user, [{"role": "assistant", "content": content}], True)
        assert tok.decode(c_ids) == content.strip() + "<|im_end|>\n"


def test_a_template_that_drops_a_role_it_does_not_know_makes_a_bad_record() -> None:
    """A "developer" turn (OpenAI's name for the system turn since o1, gpt-oss's harmony) reached a template that
    renders only its own roles (Qwen3's: system/user/assistant/tool; this Mistral style: user/assistant) and was
    left out in silence: only system and user turns were checked."""
    from coati_kto.testing.tiny import build_tokenizer

    corpus = ["Always answer in French.", "What is the capital of France?", "Paris."]
    developer = {"role": "developer", "content": "Always answer in French."}
    user = {"role": "user", "content": "What is the capital of France?"}
    completion = [{"role": "assistant", "content": "Paris."}]
    mistral = build_tokenizer(corpus, vocab_size=300, style="mistral")
    with pytest.raises(RecordError) as info:
        render(mistral, [developer, user], completion, True, "d.jsonl:5")
    assert str(info.value) == (
        "d.jsonl:5: field 'prompt[0].content': the chat template leaves this developer turn out of the prompt it "
        "renders, so the model would train without it; use a template that renders it, or remove the turn"
    )
    assert info.value.reason == "not_rendered"
    # A template that renders the role (ChatML renders any) keeps the record; tool results stay unchecked.
    chatml = build_tokenizer(corpus, vocab_size=300, style="chatml")
    prompt, _ = render(chatml, [developer, user], completion, True, "d.jsonl:5")
    assert prompt.startswith("<|im_start|>developer\nAlways answer in French.<|im_end|>\n")
    tool_turn = {"role": "tool", "content": '{"capital": "Paris"}'}
    assert render(mistral, [user, *completion, tool_turn], completion, True, "d.jsonl:5")[1] == "Paris.</s>"


def test_a_missing_tokenizer_source_is_one_line_without_hub_retries(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """prepare / inspect / precompute load the tokenizer without train's preflight: a mistyped relative
    model.path said "Repo id must use alphanumeric chars" (a path taken for a hub id), and a name shaped like a
    hub id spent ~1 min in the hub client's retries before "cannot load a tokenizer"."""
    import time

    from helpers import MINIMAL, write_config

    from coati_kto.config.load import load_config
    from coati_kto.data.tokenize import load_tokenizer
    from coati_kto.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    path = write_config(tmp_path, MINIMAL)
    with pytest.raises(ConfigError) as err:
        load_tokenizer(load_config(path, ["model.path=./modle"]).model)
    assert str(err.value) == (
        f"model.path: ./modle does not exist (a local path, read from {tmp_path}; a hub id looks like org/name)"
    )
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        load_tokenizer(load_config(path, ["model.path=org/not-cached-here"]).model)
    assert str(err.value) == (
        "model.path: org/not-cached-here is not a local directory and not in the hub cache, and HF_HUB_OFFLINE "
        "is set"
    )
    assert time.perf_counter() - start < 5


# SmolLM3-3B's handling of its system turn, verbatim: the /think and /no_think flags its model card puts in the
# system prompt set the reasoning mode and are taken out of the instructions it renders.
SMOLLM3_TEMPLATE = (
    '{%- set reasoning_mode = "/think" -%}{{- "<|im_start|>system\\n" -}}'
    '{%- if messages[0].role == "system" -%}{%- set system_message = messages[0].content -%}'
    '{%- if "/no_think" in system_message -%}{%- set reasoning_mode = "/no_think" -%}'
    '{%- elif "/think" in system_message -%}{%- set reasoning_mode = "/think" -%}{%- endif -%}'
    '{%- set custom_instructions = system_message.replace("/no_think", "").replace("/think", "").rstrip() -%}'
    "{%- endif -%}"
    '{{- "Reasoning Mode: " + reasoning_mode + "\\n\\n" -}}'
    '{%- if custom_instructions -%}{{- custom_instructions + "\\n\\n" -}}{%- endif -%}{{- "<|im_end|>\\n" -}}'
    "{%- for message in messages if message.role != 'system' -%}"
    "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def test_a_system_turn_the_template_rewrites_is_kept() -> None:
    """SmolLM3 (admitted under hybrid_parallel) with its documented "... /no_think" system prompt: every record
    was refused as a system turn left out, though the template renders it, less the flag. A system turn the
    template drops, or cuts short, is still a bad record."""
    from coati_kto.testing.tiny import build_tokenizer

    corpus = ["You are a concise assistant.", "What is the capital of France?", "Paris."]
    tok = build_tokenizer(corpus, vocab_size=300, style="chatml")
    tok.chat_template = SMOLLM3_TEMPLATE
    user = {"role": "user", "content": "What is the capital of France?"}
    completion = [{"role": "assistant", "content": "Paris."}]
    system = {"role": "system", "content": "You are a concise assistant. /no_think"}
    prompt, rendered = render(tok, [system, user], completion, True, "d.jsonl:7")
    assert prompt.startswith(
        "<|im_start|>system\nReasoning Mode: /no_think\n\nYou are a concise assistant.\n\n"
    )
    assert rendered == "Paris.<|im_end|>\n"
    tok.chat_template = SMOLLM3_TEMPLATE.replace("custom_instructions + ", "custom_instructions[:12] + ")
    with pytest.raises(
        RecordError, match=r"field 'prompt\[0\].content': the chat template leaves this system"
    ):
        render(tok, [system, user], completion, True, "d.jsonl:7")


def test_reasoning_a_template_does_not_render_makes_a_bad_record() -> None:
    """An assistant completion with its reasoning under ``reasoning_content`` (Qwen3's, DeepSeek's and vLLM's
    outputs): a template without that field (Qwen2.5's, Llama 3's) trained the answer alone with the label that
    judged both, in silence, though a dropped ``content`` or ``tool_calls`` was a bad record."""
    from coati_kto.data.chat import render
    from coati_kto.testing.tiny import build_tokenizer

    user = {"role": "user", "content": "What comes after Monday?"}
    thought = "Monday is day one, so the next is day two."
    completion = [{"role": "assistant", "reasoning_content": thought, "content": "Tuesday."}]
    chatml = build_tokenizer([user["content"], thought, "Tuesday."], vocab_size=300, style="chatml")
    with pytest.raises(RecordError) as info:
        render(chatml, [user], completion, True, "d.jsonl:4")
    assert str(info.value) == (
        "d.jsonl:4: field 'completion[0].reasoning_content': the chat template does not render this assistant "
        "turn's reasoning_content, so the model would not train on it (the answer alone would carry the label); "
        "use a template that renders reasoning_content (Qwen3's renders reasoning_content), or move it into "
        "content, or remove it"
    )
    assert info.value.reason == "not_rendered"
    for key in ("reasoning", "thinking"):  # the other names reasoning comes under
        with pytest.raises(RecordError, match=rf"field 'completion\[0\]\.{key}'"):
            render(chatml, [user], [{"role": "assistant", key: thought, "content": "Tuesday."}], True, "d:1")
    chatml.chat_template = (  # ChatML that renders the reasoning as Qwen3's does: accepted, reasoning trained
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
        "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    _, rendered = render(chatml, [user], completion, True, "d.jsonl:4")
    assert rendered == f"<think>\n{thought}\n</think>\n\nTuesday.<|im_end|>\n"
    assert render(
        chatml, [user], [{"role": "assistant", "reasoning_content": "", "content": "Tuesday."}], True, "d"
    )


# Trailing whitespace the GPT-2 / cl100k pre-tokenizer (``\s+(?!\S)``) keeps whole at the end of a text ("?\n\n" ->
# "?", "ĊĊ") but splits once text follows ("?\n\nSunday" -> "?", "Ċ", "Ċ", "Sunday"): tokenizer(prompt) then
# differs from tokenizer(prompt + completion) before the boundary though no token crosses it.
BLANK_LINE_CORPUS = [
    *CORPUS,
    *["Question: What comes before Monday?\n\n", "Sunday. The answer is 5.\n \n"] * 20,
]
SLOW_PATH_CASES = [  # (prompt, completion): the earlier slow-path tests' cases
    ("Answer: ", "5"),
    ("ca", "pital"),
    ("The answer is", " 5"),
    ("def add(a, b):\n   ", " return a + b"),
    ("x", " y"),
    ("Sum:\n", "\n\nThe answer is 5."),
    ("Sum:\n", "\n\n\nThe answer is 5."),
    ("Sum:\n", "The answer is 5."),
]


@functools.cache
def blank_line_tokenizers(style: str) -> tuple[PreTrainedTokenizerFast, object]:
    """(fast, its Python twin) of a byte-level BPE that merges "\\n\\n" and "\\n \\n", with ``style``'s template."""
    from coati_kto.testing.tiny import build_tokenizer

    fast = build_tokenizer(BLANK_LINE_CORPUS, vocab_size=400, style=style)
    return fast, python_tokenizer(fast)


@pytest.mark.parametrize("style", ["llama3", "chatml"])
def test_python_tokenizers_split_at_trailing_whitespace_like_fast_ones(style: str) -> None:
    """The common-prefix split of Python tokenizers (Qwen-1's tiktoken, GLM-4: remote code) put the prompt's
    own trailing whitespace into the loss when the pre-tokenizer splits it differently once text follows: Llama
    3's "<|end_header_id|>\\n\\n" trained "Ċ", "Ċ", "Sunday" as the answer and flagged every record's boundary
    inside a token; ChatML's generation prompt trained its own "\\n" before a completion " \\n..."; a plain
    prompt ending in a blank line trained the blank line. Tokens ending at or before the boundary are the
    prompt's, as with offsets."""
    from coati_kto.data.chat import render

    fast, slow = blank_line_tokenizers(style)
    user = [{"role": "user", "content": "What comes before Monday?"}]
    cases = [
        render(fast, user, [{"role": "assistant", "content": "Sunday."}], True, "x"),
        render(fast, [{"role": "user", "content": "Sum?"}], [{"role": "assistant", "content": " \nThe answer is 5."}], True, "x"),
        ("Question: What comes before Monday?\n\n", "Sunday."),
        *SLOW_PATH_CASES,
    ]  # fmt: skip
    prompts, completions = [p for p, _ in cases], [c for _, c in cases]
    fast_split = Encoder(fast).split(prompts, completions)
    slow_split = Encoder(slow).split(prompts, completions)
    assert slow_split == fast_split
    for p, c, prompt, completion in zip(*slow_split[:2], prompts, completions, strict=True):
        assert p + c == slow(prompt + completion, add_special_tokens=False)["input_ids"]

    (sunday_p, blank_p, plain_p), (sunday_c, blank_c, plain_c) = slow_split[0][:3], slow_split[1][:3]
    # The cases really are ones where tokenizer(prompt) is no prefix of tokenizer(whole text) (ChatML's
    # generation prompt ends in one "\n": no trailing run to split).
    for i in (0, 2) if style == "llama3" else (2,):
        alone = slow(prompts[i], add_special_tokens=False)["input_ids"]
        assert slow(prompts[i] + completions[i], add_special_tokens=False)["input_ids"][: len(alone)] != alone
    tokens = fast.convert_ids_to_tokens
    assert tokens(plain_p)[-3:] == ["?", "Ċ", "Ċ"] and tokens(plain_c) == ["Sunday", "."]
    assert slow.decode(plain_p) == prompts[2]
    assert slow.decode(sunday_p) == prompts[0] and tokens(sunday_c)[:2] == ["Sunday", "."]
    if style == "llama3":
        assert tokens(sunday_p)[-3:] == ["<|end_header_id|>", "Ċ", "Ċ"]
    # " \n...": "\n " straddles the boundary holding only completion whitespace: it stays with the prompt.
    assert slow.decode(blank_p) == prompts[1] + " " and slow.decode(blank_c).startswith("\nThe answer is 5.")
    assert slow_split[2] == [False, True, False, True, True, False, False, False, True, True, False]


@settings(max_examples=100, deadline=None)
@given(TEXT, TEXT.filter(str.strip))
def test_python_tokenizer_split_invariants(prompt: str, completion: str) -> None:
    """Whatever whitespace meets at the boundary, the Python tokenizer's split is the offsets split."""
    fast, slow = blank_line_tokenizers("chatml")
    split = Encoder(slow).split([prompt], [completion])
    assert split == Encoder(fast).split([prompt], [completion])
    assert split[0][0] + split[1][0] == slow(prompt + completion, add_special_tokens=False)["input_ids"]


def test_python_tokenizer_split_decodes_only_near_the_boundary(monkeypatch: pytest.MonkeyPatch) -> None:
    """The split decodes a few tokens around the boundary per row, not the row at every candidate k (quadratic
    in the row's length)."""
    fast, slow = blank_line_tokenizers("chatml")
    prompt = "The answer is 5. " * 300 + "Question: What comes before Monday?\n\n"
    completion = "Sunday. " * 300
    decode, decoded = slow.decode, []
    monkeypatch.setattr(slow, "decode", lambda ids, **kw: decoded.append(len(ids)) or decode(ids, **kw))
    (p_ids,), (c_ids,), _ = Encoder(slow).split([prompt], [completion])
    (fast_p,), (fast_c,), _ = Encoder(fast).split([prompt], [completion])
    assert (p_ids, c_ids) == (fast_p, fast_c)
    assert len(p_ids) + len(c_ids) > 1000 and 0 < sum(decoded) < 60


def test_a_reference_whose_tokenizer_reads_the_ids_otherwise_is_refused(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """From an audit: a model.reference_path with a tokenizer of its own (another vocabulary, as large) trained
    without a word, the reference scoring other tokens than the policy's (step 1's kl 4.04, not 0). Its added
    tokens may differ (a chat model's renamed special tokens): only the vocabulary both define is compared."""
    import json
    import shutil

    from coati_kto.config.schema import ModelSection
    from coati_kto.data.vocabulary import reference_tokenizer_problem

    def reference(name: str, edit) -> ModelSection:
        folder = tmp_path / name
        shutil.copytree(tiny_model_dir, folder)
        tokenizer = json.loads((folder / "tokenizer.json").read_text())
        edit(tokenizer)
        (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
        return ModelSection(path=str(tiny_model_dir), reference_path=str(folder))

    def swap(tokenizer: dict) -> None:  # two tokens trade ids: the same size, other meanings
        vocab = tokenizer["model"]["vocab"]
        a, b = (t for t, i in vocab.items() if i in (100, 101))
        vocab[a], vocab[b] = vocab[b], vocab[a]

    def rename_added(tokenizer: dict) -> None:
        tokenizer["added_tokens"][-1]["content"] = "<|renamed|>"

    swapped = reference("swapped", swap)
    line = reference_tokenizer_problem(swapped)
    assert line == (
        f"model.reference_path {swapped.reference_path}: its tokenizer reads the run's token ids as other tokens "
        "(2 of the 390 ids both define; id 100 is '¥' there and '¤' here): the reference would score other text; "
        "give it a model of the run's tokenizer"
    )
    assert reference_tokenizer_problem(reference("same", lambda t: None)) is None
    assert reference_tokenizer_problem(reference("renamed", rename_added)) is None
    assert reference_tokenizer_problem(ModelSection(path=str(tiny_model_dir))) is None
