"""Tiny models and byte-level BPE tokenizers built offline (no hub): for tests and the CPU quickstart.

``build_llama`` / ``save_tiny_model``: the suite's default tiny Llama with a ChatML tokenizer (the builder of
``coati-kto tiny-model``: ``coati_kto.models.tiny``).
``save_tiny_family``: one tiny random model per supported family (Llama, Mistral, Qwen2; Qwen3 and Gemma for the
families shardformer lacks), each with its family's chat-template style and the shape features that broke real
runs (a vocabulary that is not a multiple of 64, tied embeddings, attention bias, grouped-query and
sliding-window attention).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedModel, PreTrainedTokenizerFast

# The ChatML template and the Llama builder live with the user-facing `coati-kto tiny-model` (one builder).
from coati_kto.models.tiny import CHATML_TEMPLATE, SPECIAL_TOKENS, bpe_tokenizer, build_llama
from coati_kto.testing.tiny_types import late_2026_shapes

# Llama-3 style: header tokens around the role, <|eot_id|> ends a turn.
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# Mistral [INST] style: user turns inside [INST] ... [/INST], assistant turns end with </s>.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "[INST] {{ message['content'] }} [/INST]{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
# Gemma style: <start_of_turn>role ... <end_of_turn>, the assistant role called "model"; its EOS is <eos>.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n{{ message['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
# style -> (special tokens, bos, eos, pad, chat template). The template ends an assistant turn with: chatml
# <|im_end|> (its EOS: Qwen instruct); chatml_s the same, but EOS "</s>"; llama3 <|eot_id|> (its EOS: Llama 3
# instruct); llama3_base the same, but EOS <|end_of_text|> (Llama 3 base under an instruct template); gemma
# <end_of_turn>, EOS <eos>; mistral </s> (its EOS).
TOKENIZER_STYLES: dict[str, tuple[list[str], str, str, str, str]] = {
    "chatml": (SPECIAL_TOKENS, "<|im_start|>", "<|im_end|>", "<|endoftext|>", CHATML_TEMPLATE),
    "chatml_s": ([*SPECIAL_TOKENS, "</s>"], "<|im_start|>", "</s>", "<|endoftext|>", CHATML_TEMPLATE),
    "llama3_base": (
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
        + ["<|finetune_pad|>"],
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|finetune_pad|>",
        LLAMA3_TEMPLATE,
    ),
    "gemma": (GEMMA_SPECIALS, "<bos>", "<eos>", "<pad>", GEMMA_TEMPLATE),
    "llama3": (
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|finetune_pad|>"],
        "<|begin_of_text|>",
        "<|eot_id|>",
        "<|finetune_pad|>",
        LLAMA3_TEMPLATE,
    ),
    "mistral": (["<unk>", "<s>", "</s>", "<pad>"], "<s>", "</s>", "<pad>", MISTRAL_TEMPLATE),
}


def build_tokenizer(
    corpus: Iterable[str],
    vocab_size: int = 512,
    pad_is_eos: bool = False,
    style: str = "chatml",
    eos_token: str | None = None,
) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on ``corpus`` with a chat template of ``style`` (TOKENIZER_STYLES); ChatML's
    eos is ``<|im_end|>``. ``eos_token`` (one of the style's special tokens) replaces the style's EOS: the
    same vocabulary and ids, another EOS.

    ``pad_is_eos`` reproduces the common (and dangerous) setup where padding and end-of-sequence share an id.
    """
    special, bos, eos, pad, template = TOKENIZER_STYLES[style]
    eos = eos_token or eos
    return bpe_tokenizer(corpus, vocab_size, special, bos, eos, eos if pad_is_eos else pad, template)


def build_sentencepiece_tokenizer(corpus: list[str], vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """A Gemma-like SentencePiece-style tokenizer: BPE over "▁"-words (Metaspace, prepend_scheme "first"), BOS
    added to plain text, Gemma's turn template; its EOS ``<eos>`` differs from the template's ``<end_of_turn>``."""
    from tokenizers.processors import TemplateProcessing

    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    specials = ["<unk>", *GEMMA_SPECIALS]
    alphabet = sorted({c for text in corpus for c in text.replace(" ", "▁")} | {"▁", "\n"})
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.post_processor = TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tok.token_to_id("<bos>"))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<pad>",
        chat_template=GEMMA_TEMPLATE,
        padding_side="right",
    )


def save_tiny_model(
    out_dir: str | Path, corpus: Iterable[str], vocab_size: int = 512, **model_kwargs
) -> Path:
    """Build a tokenizer and a Llama and save both, HF-format, into ``out_dir`` (what ``model.path`` points to)."""
    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(corpus, vocab_size=vocab_size)
    model = build_llama(tokenizer, **model_kwargs)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def save_perturbed(model_dir: str | Path, out_dir: str | Path, seed: int) -> Path:
    """``model_dir``'s model with noise added, saved in ``out_dir``: a reference that differs from the policy.

    Every weight gets noise of std 0.02, the output layer 0.2: logits with noise of std s put on average about
    s**2 / 2 nats less on a random token, so the KL log-ratios on random sequences are clearly positive (z0 > 0,
    unclamped).
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
        model.lm_head.weight.add_(0.2 * torch.randn(model.lm_head.weight.shape, generator=gen))
    model.save_pretrained(out_dir)
    return Path(out_dir)


# family -> (chat-template style, what its tiny model covers). Sizes: hidden 32, 1 layer, 4 heads (tp_size 2 works).
FAMILIES: dict[str, tuple[str, str]] = {
    "llama": ("llama3", "vocabulary not a multiple of 64, grouped-query attention (4 heads, 2 kv heads)"),
    "mistral": (
        "mistral",
        "sliding-window attention (window 8), grouped-query attention, vocabulary of 64 x k",
    ),
    "qwen2": (
        "chatml",
        "tied input/output embeddings, attention bias, odd vocabulary, grouped-query attention",
    ),
    "qwen3": (
        "chatml",
        "tied embeddings, per-head q/k norms (their gradients summed under tensor parallelism)",
    ),
    "gemma3": (
        "chatml",
        "tied scaled embeddings, (1 + w) norms, q/k norms, soft-capping, sliding and full layers mixed (window 8)",
    ),
    # No tensor-parallel policy (plugin.tp_size 1 only): Gemma 3 4B-27B's composite shape.
    "gemma3_vl": (
        "chatml",
        "the gemma3 text model behind a SigLIP vision tower and a random projector (Gemma3ForConditionalGeneration: "
        "text config nested, tower frozen, its own masks and logits)",
    ),
    # transformers 5 only; Llama's module names (families/shardformer/smollm3.py): every plugin.
    "smollm3": ("llama3", "tied embeddings, layers without RoPE (no_rope_layers), grouped-query attention"),
    # Gemma (1): no tensor-parallel policy, refused above plugin.tp_size 1 (test_plan_config.py).
    "gemma": ("chatml", "tied embeddings, scaled embeddings (no shardformer policy)"),
    # Phi-3 / Phi-4: fused qkv_proj and gate_up_proj, split part by part under tensor parallelism.
    "phi3": (
        "chatml",
        "fused qkv and gate-up projections (split without mixing heads), grouped-query attention",
    ),
    # Gemma 4 (text): transformers 5.24's defaults shrunk, with every feature a tensor-parallel split must keep.
    "gemma4": (
        "chatml",
        "per-layer inputs, sliding and full layers with their own head_dim and key-value heads, values = keys in "
        "full layers (attention_k_eq_v), kv-shared layers with a double-wide MLP, soft-capping, tied scaled embeddings",
    ),
    # Qwen 3.5 (dense text): Gated DeltaNet linear attention (fused qkv, depthwise conv1d) and gated full attention.
    "qwen3_5": (
        "chatml",
        "linear-attention layers (Gated DeltaNet: fused qkv, conv1d, 2 key heads serving 4 value heads) and gated "
        "full-attention layers with q/k norms",
    ),
    # The hub checkpoints' classes (Gemma4ForConditionalGeneration, Qwen3_5ForConditionalGeneration) around them.
    "gemma4_vl": (
        "chatml",
        "the gemma4 text model behind a one-layer Gemma 4 vision tower (Gemma4ForConditionalGeneration)",
    ),
    "qwen3_5_vl": (
        "chatml",
        "the qwen3_5 text model behind Qwen 3.5's vision tower (Qwen3_5ForConditionalGeneration)",
    ),
    # OLMo 3: q/k norms over the whole projection (all heads), sliding and full layers mixed.
    "olmo3": (
        "chatml",
        "q/k RMSNorm over all heads (reduced across tensor-parallel ranks), sliding and full layers",
    ),
}


def random_causal_lm(
    model_class: type[PreTrainedModel], config_class: type, seed: int = 0, **config: object
) -> PreTrainedModel:
    """``model_class(config_class(...))``, randomly initialised from ``seed``, test-sized by default (vocabulary
    200, hidden 32, 2 layers, 4 heads over 2 key-value heads, no dropout); ``config`` overrides any key."""
    shape: dict[str, object] = dict(
        vocab_size=200,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attention_dropout=0.0,
    )
    torch.manual_seed(seed)
    return model_class(config_class(**{**shape, **config}))


def _family_shapes(exact: int) -> dict[str, tuple[str, str, dict[str, Any]]]:
    """family -> (transformers model class, config class, its config keys) for ``build_family_model``."""
    return {
        "llama": ("LlamaForCausalLM", "LlamaConfig", dict(tie_word_embeddings=False)),
        "mistral": (
            "MistralForCausalLM",
            "MistralConfig",
            dict(vocab_size=-(-exact // 64) * 64, sliding_window=8, head_dim=8, tie_word_embeddings=False),
        ),
        "qwen2": (
            "Qwen2ForCausalLM",
            "Qwen2Config",
            dict(tie_word_embeddings=True, use_sliding_window=False),
        ),
        "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(tie_word_embeddings=True, head_dim=8)),
        "gemma": ("GemmaForCausalLM", "GemmaConfig", dict(head_dim=8)),
        "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(tie_word_embeddings=False)),
        "olmo3": (
            "Olmo3ForCausalLM",
            "Olmo3Config",
            dict(num_hidden_layers=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
        ),
        "gemma3": (
            "Gemma3ForCausalLM",
            "Gemma3TextConfig",
            dict(
                head_dim=8,
                num_hidden_layers=2,
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention"],
                tie_word_embeddings=True,
            ),
        ),
        "smollm3": (
            "SmolLM3ForCausalLM",
            "SmolLM3Config",
            dict(num_hidden_layers=2, no_rope_layers=[1, 0], tie_word_embeddings=True),
        ),
        **late_2026_shapes(exact),
    }


def build_family_model(
    family: str, tokenizer: PreTrainedTokenizerFast, seed: int = 0, num_layers: int | None = None
) -> PreTrainedModel:
    """A random ``family`` causal LM (FAMILIES) sized for CPU tests, its vocabulary fitted to ``tokenizer``."""
    import transformers

    exact = len(tokenizer)  # odd for the corpus used in tests: padded by shardformer
    if family in ("gemma3_vl", "gemma4_vl", "qwen3_5_vl"):
        from coati_kto.testing.tiny_vision import build_vision_language

        text = build_family_model(family[: -len("_vl")], tokenizer, seed).config
        return build_vision_language(family, text, tokenizer, seed)
    common = dict(
        vocab_size=exact,
        num_hidden_layers=1,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    shapes = _family_shapes(exact)
    if family not in shapes:
        raise ValueError(f"unknown tiny family {family!r}; known: {sorted(FAMILIES)}")
    model_class, config_class, specific = shapes[family]
    layers = {} if num_layers is None else {"num_hidden_layers": num_layers}
    return random_causal_lm(
        getattr(transformers, model_class),
        getattr(transformers, config_class),
        seed,
        **{**common, **specific, **layers},
    )


def save_tiny_family(
    out_dir: str | Path,
    family: str,
    corpus: Iterable[str],
    vocab_size: int = 300,
    num_layers: int | None = None,
) -> Path:
    """Build ``family``'s tokenizer (its chat-template style) and tiny model (``num_layers`` decoder layers: the
    family's tiny default when None); save both HF-format in ``out_dir``."""
    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(corpus, vocab_size=vocab_size, style=FAMILIES[family][0])
    build_family_model(family, tokenizer, num_layers=num_layers).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
