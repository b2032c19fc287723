"""A causal LM's shape from its config.json alone: parameter counts by how tensor parallelism splits them.

``model_shape(source)`` reads config.json (a local directory, or a Hub id already in the hub cache), builds the
model class on the meta device (no weights read, no memory taken) and counts its parameters exactly, each tied
tensor once. It sorts them the way the hybrid_parallel plugin's shardformer splits them: the vocabulary rows
(embeddings and an untied LM head, padded to a multiple of 64 x tp_size and split by rows), the decoder layers'
projections (split by tp_size) and what every tensor-parallel rank keeps whole (norms, routers' biases).

A mixture of experts runs each token through its top-k routed experts (and a shared expert where the family has
one), each keeping its own intermediate activations: ``mlp_intermediate`` is that width per token, read from the
meta model's experts (the widest layer where dense and MoE layers mix).

A shape field config.json lacks is a ConfigError naming it (``AutoConfig.for_model`` would fill the family's
default: another model) where the family's class has a value for it (not one it computes, such as head_dim). A
vision-language config's text model nested under ``text_config`` is what transformers writes as a diff against
the text class's defaults (Gemma 3 4B and LLaVA 1.5's hub configs omit their heads and sizes): the fields it
omits are taken from those defaults and named in ``defaulted``, not refused. Its vision tower and projector are
``tower_params`` (:func:`tower_ids`): whole on every tensor-parallel rank (the policies split the language model),
on the first pipeline stage, trained only with ``model.train_vision``, never LoRA targets.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coati_kto.config.hub import hub_id, local_snapshot
from coati_kto.errors import ConfigError
from coati_kto.families import vision_language

VOCAB_MULTIPLE = 64  # HybridParallelPlugin's make_vocab_size_divisible_by
VOCAB_NAMES = ("embed_tokens", "lm_head", "wte", "embed_out", "word_embeddings", "embed_in")
# The text config's fields that shape the plan (names as the config class spells them, or through its
# attribute_map: gpt2's n_embd, n_layer...).
SHAPE_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)
SHARED_EXPERTS = ("shared_expert", "shared_experts", "shared_mlp")  # a MoE block's always-on expert
_BUILT: dict[str, ModelShape] = {}  # this process's shapes by their config.json's content (model_shape)


@dataclass(frozen=True)
class ModelShape:
    """What the memory plan reads of a model: its sizes and its parameters sorted by tensor-parallel split."""

    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    vocab_params: int  # embeddings and an untied head: vocab x hidden each
    split_params: int  # the decoder layers' projections (and their biases): 1/tp each
    whole_params: int  # norms and the like: whole on every tensor-parallel rank
    lora_linears: tuple[tuple[str, int, int], ...]  # (name, in, out) of each Linear in the decoder's layers
    outer_whole_params: int = 0  # of whole_params, those outside the decoder layers (the final norm)
    # Per token, the MLP's intermediate width: top-k x a routed expert's + a shared expert's (MoE; the widest
    # layer where layers mix dense and MoE MLPs); 0: a dense ``intermediate``.
    mlp_intermediate: int = 0
    # The top-k experts a token runs through (0: dense); each copies its input and output.
    routed_experts: int = 0
    # text_config's shape fields taken from the family's defaults (module docstring).
    defaulted: tuple[str, ...] = ()
    # A vision-language model's vision tower and projector: whole on every rank, frozen unless train_vision.
    tower_params: int = 0

    @property
    def params(self) -> int:
        """Every parameter, each tied tensor once."""
        return self.vocab_params + self.split_params + self.whole_params + self.tower_params

    def params_per_rank(self, tp: int) -> int:
        """Parameters one tensor-parallel rank holds: vocabulary rows padded to 64 x tp and split, projections
        split (rounded up), the rest whole."""
        vocab_tensors = self.vocab_params // max(1, self.vocab * self.hidden)
        rows = self.vocab if tp == 1 else math.ceil(self.vocab / (VOCAB_MULTIPLE * tp)) * VOCAB_MULTIPLE * tp
        vocab = vocab_tensors * rows // tp * self.hidden
        return vocab + math.ceil(self.split_params / tp) + self.whole_params + self.tower_params

    def stage_params(self, tp: int, layers: int, first: bool, last: bool) -> int:
        """Parameters one rank of a pipeline stage holds: ``layers`` decoder layers (their share of the split and
        whole parameters), the embedding on the first stage, the final norm and the LM head on the last (a tied
        embedding on both); split by tensor parallelism as :meth:`params_per_rank`."""
        vocab_tensors = self.vocab_params // max(1, self.vocab * self.hidden)
        rows = self.vocab if tp == 1 else math.ceil(self.vocab / (VOCAB_MULTIPLE * tp)) * VOCAB_MULTIPLE * tp
        held = ((max(vocab_tensors - 1, 1) if first else 0) + (1 if last else 0)) if vocab_tensors else 0
        vocab = held * rows // tp * self.hidden
        split = math.ceil(self.split_params * layers / self.layers / tp)
        whole = (self.whole_params - self.outer_whole_params) * layers // self.layers
        ends = (self.outer_whole_params if last else 0) + (self.tower_params if first else 0)
        return vocab + split + whole + ends

    def lora_params(self, rank: int, targets: list[str]) -> int:
        """Adapter parameters: r x (in + out) for every Linear one of ``targets`` names as peft matches it (the
        module's name equal to the target or ending with ``.`` and it: ``q_proj``, ``self_attn.q_proj``)."""
        return sum(
            rank * (i + o)
            for name, i, o in self.lora_linears
            if any(name == t or name.endswith("." + t) for t in targets)
        )


_WORKING_DTYPES = {"bf16": ("bfloat16", "BF16"), "fp16": ("float16", "F16")}  # config.json's, safetensors'
_FLOAT_HEADER_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})


def cast_rounds(source: str, precision: str, key: str = "model.path") -> bool:
    """Whether the plugin's cast to ``precision``'s working dtype rounds the checkpoint's weights: a floating
    tensor is stored in another dtype. Read from the safetensors headers (no weights read), else from
    config.json (``dtype``, ``torch_dtype`` before transformers 5; fp32 when it says nothing, transformers' own
    default): a config can say bfloat16 beside fp32 tensors (a converted or consolidated checkpoint). Then the
    masters start from the fp32 values kept through the cast (``coati_kto.parallel.masters``). False for an fp32
    run (no cast)."""
    if precision not in _WORKING_DTYPES:
        return False
    config_name, header_name = _WORKING_DTYPES[precision]
    stored = stored_float_dtypes(source)
    if stored:
        return stored != {header_name}
    raw = read_config_json(source, key)
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    named = raw.get("dtype") or raw.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
    return str(named or "float32").removeprefix("torch.") != config_name


def stored_float_dtypes(source: str) -> set[str] | None:
    """The safetensors dtypes (``F32``, ``BF16``, ...) of the floating tensors of the checkpoint at ``source`` (a
    directory, or a Hub id's cached snapshot), from each file's header; None where it has no safetensors here."""
    from safetensors import safe_open

    files = _safetensors_files(source)
    if not files:
        return None
    stored: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as opened:
            stored.update(opened.get_slice(name).get_dtype() for name in opened.keys())  # noqa: SIM118
    return stored & _FLOAT_HEADER_DTYPES


def _safetensors_files(source: str) -> list[Path]:
    folder = local_snapshot(source)
    if folder is None:
        return []
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError):
            return []
        paths = [folder / shard for shard in shards]
        return paths if all(p.is_file() for p in paths) else []
    single = folder / "model.safetensors"
    return [single] if single.is_file() else []


def read_config_json(source: str, key: str = "model.path") -> dict[str, Any]:
    """config.json of a local directory, or of a Hub id from the hub cache (no download): ConfigError one line
    when there is none."""
    folder = Path(source).expanduser()
    if folder.is_dir():
        path = folder / "config.json"
        if not path.is_file():
            raise ConfigError(
                f"{key}: {source} has no config.json (the plan reads the model's shape from it)"
            )
        return _parse(path, key)
    if hub_id(source) is None:
        raise ConfigError(f"{key}: {source} does not exist (a local directory, or a hub id like org/name)")
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(source, "config.json")
    if not isinstance(cached, str):
        raise ConfigError(
            f"{key}: {source} is not in the hub cache (the plan reads only config.json: download it with "
            f"`hf download {source} config.json`, or set {key} to a directory holding it)"
        )
    return _parse(Path(cached), key)


def _parse(path: Path, key: str) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"{key}: {path}: not a JSON config ({err})") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ConfigError(f"{key}: {path}: no model_type (not a transformers config.json)")
    return raw


def model_shape(source: str, key: str = "model.path") -> ModelShape:
    """The shape of the model config.json describes (module docstring); ConfigError one line for a config
    transformers cannot build. Meta-built once per config.json content in a process (a large model's takes 0.1
    CPU-second): a run's load check and its plan line ask for the same models."""
    raw = read_config_json(source, key)
    text = json.dumps(raw, sort_keys=True)
    if text not in _BUILT:
        _BUILT[text] = _built_shape(raw, source, key)
    return _BUILT[text]


def _built_shape(raw: dict[str, Any], source: str, key: str) -> ModelShape:
    """:func:`model_shape` of config.json ``raw``, built on the meta device (``source``, ``key``: its errors')."""
    import torch
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from coati_kto.families import auto_model_class

    if raw["model_type"] not in CONFIG_MAPPING:
        raise ConfigError(
            f"{key}: {source}: model_type {raw['model_type']!r} is not one this transformers knows"
        )
    # Any failure of transformers' own code on this config is one line, not a traceback.
    try:
        config = AutoConfig.for_model(**raw)
        with torch.device("meta"):
            model = auto_model_class(config).from_config(config)
    except Exception as err:
        why = (
            " ".join(str(err).split())[:300] or type(err).__name__
        )  # one line, however long transformers' is
        raise ConfigError(f"{key}: {source}: transformers cannot build its config.json ({why})") from None
    text = config.get_text_config()
    defaulted = _defaulted_fields(raw, type(text))
    if defaulted and not isinstance(raw.get("text_config"), dict):
        raise ConfigError(
            f"{key}: {_config_path(source)} has no {', '.join(defaulted)} (transformers would take "
            f"{type(text).__name__}'s defaults: another model's shape)"
        )
    # A config without one hidden size or head count (Gemma 4's per-layer head_dim): one line too.
    try:
        shape = _count(model, text)
    except Exception as err:
        raise ConfigError(
            f"{key}: {source}: the plan reads no single decoder shape from it ({err})"
        ) from None
    return dataclasses.replace(shape, defaulted=tuple(defaulted))


def head_is_plain(source: str, key: str = "model.path") -> bool:
    """Whether the model config.json describes scores through the chunked LM head at tp 1:
    ``coati_kto.families.plain_head`` of the config its model carries, as the runtime asks it
    (``coati_kto.models.lm_head.LMHead.find``). A vision-language wrapper is asked as itself, not as its text
    model: LLaVA's text model is a Llama, yet its logits path runs. ConfigError one line as :func:`model_shape`."""
    raw = read_config_json(source, key)
    from transformers import AutoConfig

    from coati_kto.families import plain_head

    try:
        return plain_head(AutoConfig.for_model(**raw))
    except Exception as err:
        why = " ".join(str(err).split())[:300] or type(err).__name__
        raise ConfigError(f"{key}: {source}: transformers cannot build its config.json ({why})") from None


def _config_path(source: str) -> str:
    """The config.json ``source`` is read from (a Hub id's: its path in the hub cache)."""
    folder = Path(source).expanduser()
    if folder.is_dir():
        return str(folder / "config.json")
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(source, "config.json")
    return cached if isinstance(cached, str) else f"{source}'s config.json"


def _defaulted_fields(raw: dict[str, Any], text_class: type) -> list[str]:
    """The :data:`SHAPE_FIELDS` config.json ``raw`` leaves to ``text_class``'s defaults: those the class has a
    value for (None: it computes them, as head_dim, or they are optional) that neither ``raw`` nor its nested
    ``text_config`` sets under any of its names (the class's ``attribute_map`` relates them either way: gpt2 reads
    hidden_size as n_embd, Qwen3-MoE writes num_experts as num_local_experts); named as the class's field."""
    if not dataclasses.is_dataclass(text_class):
        return []
    defaults = {f.name: f.default for f in dataclasses.fields(text_class)}
    aliases = getattr(text_class, "attribute_map", {}) or {}
    nested = raw.get("text_config")
    given = {**raw, **nested} if isinstance(nested, dict) else raw
    missing: list[str] = []
    for key in SHAPE_FIELDS:
        names = {key, aliases.get(key, key), *(a for a, b in aliases.items() if b == key)}
        name = next((n for n in sorted(names) if n in defaults), None)
        if name is None or defaults[name] is None or defaults[name] is dataclasses.MISSING:
            continue
        if not names & given.keys() and name not in missing:
            missing.append(name)
    return missing


def tower_ids(model: Any) -> set[int]:
    """The ids of a vision-language ``model``'s trainable parameters outside its decoder and output embeddings:
    the tower and projector ``coati_kto.models.hf.freeze_vision_tower`` freezes; empty for a text-only model."""
    if not vision_language(getattr(model, "config", None)):
        return set()
    text = {id(p) for m in (model.get_decoder(), model.get_output_embeddings()) for p in m.parameters()}
    return {id(p) for p in model.parameters() if id(p) not in text and p.requires_grad}


def _count(model: Any, text: Any) -> ModelShape:
    """The shape of the meta ``model`` (``text``: its text config)."""
    from torch import nn

    tower = tower_ids(model)
    counts = {"vocab": 0, "split": 0, "whole": 0, "outer": 0, "tower": 0}
    for name, param in model.named_parameters():  # each tied tensor once
        leaf = name.rsplit(".", 2)[-2] if "." in name else name
        if id(param) in tower:
            counts["tower"] += param.numel()
        elif leaf in VOCAB_NAMES:
            counts["vocab"] += param.numel()
        elif ".layers." in name and "norm" not in name and param.dim() >= 1 and "gate.weight" not in name:
            counts["split"] += param.numel()
        else:
            counts["whole"] += param.numel()
            counts["outer"] += 0 if ".layers." in name else param.numel()
    linears = tuple(  # the decoder's: LoRA targets no module of the tower (config.lora.peft_targets)
        (name, m.in_features, m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and ".layers." in name and id(m.weight) not in tower
    )
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    intermediate = int(getattr(text, "intermediate_size", None) or 4 * text.hidden_size)
    routed, width = _mlp_width(model, int(text.hidden_size), intermediate, int(text.num_hidden_layers))
    return ModelShape(
        model_type=str(text.model_type),
        hidden=int(text.hidden_size),
        layers=int(text.num_hidden_layers),
        heads=heads,
        kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=head_dim,
        intermediate=intermediate,
        vocab=int(text.vocab_size),
        vocab_params=counts["vocab"],
        split_params=counts["split"],
        whole_params=counts["whole"],
        lora_linears=linears,
        outer_whole_params=counts["outer"],
        mlp_intermediate=width,
        routed_experts=routed,
        tower_params=counts["tower"],
    )


def _mlp_width(model: Any, hidden: int, dense: int, layers: int) -> tuple[int, int]:
    """(top-k, intermediate width per token) of the meta ``model``'s MoE layers: a layer whose MLP holds
    ``experts`` runs each token through its router's ``top_k`` of them and any shared expert; (0, 0) for a dense
    model. The widest of its ``layers`` (``dense``: those without experts), the most top-k."""
    blocks = []
    for name, module in model.named_modules():
        if not name.endswith(".experts") or ".layers." not in name or "attn" in name or "attention" in name:
            continue
        block = model.get_submodule(name.rsplit(".", 1)[0])
        top_k = next((m.top_k for m in block.modules() if isinstance(getattr(m, "top_k", None), int)), 1)
        shared = sum(_down_width(child, hidden) for n, child in block.named_children() if n in SHARED_EXPERTS)
        blocks.append((top_k, top_k * (_expert_width(module, hidden) or dense) + shared))
    if not blocks:
        return 0, 0
    width = max([w for _, w in blocks] + ([dense] if len(blocks) < layers else []))
    return max(k for k, _ in blocks), width


def _expert_width(experts: Any, hidden: int) -> int:
    """One routed expert's intermediate width: the experts' ``intermediate_dim`` (``expert_dim``), else the
    dimension of their 3-D down projection [experts, hidden, width] (or transposed) that is not ``hidden``, else
    the first expert module's (a ModuleList); 0 when none tells."""
    for attr in ("intermediate_dim", "expert_dim"):
        if isinstance(getattr(experts, attr, None), int):
            return int(getattr(experts, attr))
    down = getattr(experts, "down_proj", None)
    if down is not None and getattr(down, "dim", lambda: 0)() == 3:
        rows, cols = down.shape[1:]
        return int(cols if rows == hidden else rows)
    first = next(iter(experts.children()), None)
    return _down_width(first, hidden) if first is not None else 0


def _down_width(mlp: Any, hidden: int) -> int:
    """An MLP's intermediate width: the input of its down projection (a Linear back to ``hidden``, the last)."""
    from torch import nn

    downs = [m for m in mlp.modules() if isinstance(m, nn.Linear) and m.out_features == hidden]
    return downs[-1].in_features if downs else 0
