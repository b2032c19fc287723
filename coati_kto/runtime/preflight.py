"""Checks run before anything heavy (no model load, no process group): every problem at once, one line each.

``check_training(config)`` raises ConfigError listing: model / tokenizer / reference sources (a value that
looks like a path must be a directory holding a loadable model; a hub id is looked up only when the value
cannot be a path, once, with no retries, and not at all under HF_HUB_OFFLINE beyond the local cache), the
resume checkpoint, an output.dir that is writable, holds no other run and is not in use by a live one, wandb when
logging.wandb is on, Hub datasets (revision, config, split, access: coati_kto.data.hub.check) and, for
output.push_to_hub, a token.
Filesystem reads only (plus those hub requests): every rank may call it, and the ``--nproc-per-node``
launcher calls it once before starting the workers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from pathlib import Path

from coati_kto.config.hub import (
    HubDataset,
    hub_offline,
    hub_token,
    is_hub_dataset,
    missing_path,
    offline_name,
)
from coati_kto.config.hub import hub_problems as _hub_problems
from coati_kto.config.hub import looks_like_path as _looks_like_path
from coati_kto.config.lora import (
    PEFT_LAYERS,
    embedding_refusal,
    linear_layer_names,
    peft_config,
    target_matches,
    tower_refusal,
)
from coati_kto.config.output import OutputSection
from coati_kto.config.schema import Config, DataSection, ModelSection, PluginSection, TrainSection
from coati_kto.data.files import missing_entry, resolve_files
from coati_kto.data.hub import check as hub_check
from coati_kto.errors import ConfigError, DataError
from coati_kto.families import auto_model_class, vision_language_refusal
from coati_kto.runtime.resume_checks import RESUME_SAID_ENV as RESUME_SAID_ENV
from coati_kto.runtime.resume_checks import announce_resume as announce_resume
from coati_kto.runtime.resume_checks import resume_notice as resume_notice
from coati_kto.runtime.resume_checks import resume_problems, starts_from_zero
from coati_kto.runtime.run_dir import in_use, lock_holder, previous_run
from coati_kto.runtime.wandb_check import wandb_problems

_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_training(config: Config) -> None:
    """Raise ConfigError naming every problem found (one line each); return quietly when there is none.

    The one check that reads the whole config: each part below gets the sections it checks."""
    output = config.training_output()  # training needs an output section (prepare does not)
    problems: list[str] = []
    model = config.model
    problems += _source_problems("model.path", model.path, model.trust_remote_code, need_weights=True)
    if model.reference_path:
        problems += _source_problems(
            "model.reference_path", model.reference_path, model.trust_remote_code, need_weights=True
        )
    if model.tokenizer:
        problems += _source_problems(
            "model.tokenizer", model.tokenizer, model.trust_remote_code, need_weights=False
        )
    elif Path(model.path).expanduser().is_dir():  # the tokenizer defaults to model.path
        problems += _directory_problems(
            "model.path (the tokenizer)",
            Path(model.path).expanduser(),
            model.trust_remote_code,
            need_weights=False,
        )
    # A Hub dataset: revision, config, split and access, asked of the Hub (the cache offline) by the launcher and
    # global rank 0, which builds the data: not by every rank of a large job
    problems += _data_problems(config.data, ask_hub=os.environ.get("RANK", "0") == "0")
    problems += [f"model.path {why}" for why in [vision_language_refusal(model.path)] if why]
    if model.reference_path:  # imported here: transformers costs seconds, and only such a run pays them
        from coati_kto.data.vocabulary import reference_tokenizer_problem

        problems += [why for why in [reference_tokenizer_problem(model)] if why]
    problems += _lora_problems(model)
    problems += _attention_problems(model, config.plugin)
    problems += resume_problems(config.train, output, config.model_dump(mode="json"))
    problems += _output_problems(config.train, output)
    problems += push_problems(output)
    problems += wandb_problems(config.logging)
    if problems:
        raise ConfigError("\n".join(problems))


# ---------------------------------------------------------------------------------------------- model sources
def check_preparing(config: Config) -> None:
    """``prepare`` and ``inspect``: the tokenizer's source and the data files, every problem at once (ConfigError,
    one line each). The Hub is not asked here: ``prepare`` asks it for each dataset as it reads it."""
    if problems := _preparing_problems(config):
        raise ConfigError("\n".join(problems))


def check_precomputing(config: Config) -> None:
    """``precompute``: what ``check_preparing`` checks and the reference's source, with its weights (scored, and
    fingerprinted by content), every problem at once (ConfigError, one line each). A missing reference was found
    only after prepare, which can take hours."""
    model = config.model
    key = "model.reference_path" if model.reference_path else "model.path"
    reference = model.reference_path or model.path
    problems = _preparing_problems(config)
    problems += _source_problems(key, reference, model.trust_remote_code, need_weights=True)
    if problems:  # model.path as tokenizer and as reference may give one line twice (a missing directory)
        raise ConfigError("\n".join(dict.fromkeys(problems)))


def _preparing_problems(config: Config) -> list[str]:
    model = config.model
    source = ("model.tokenizer", model.tokenizer) if model.tokenizer else ("model.path", model.path)
    problems = _source_problems(*source, model.trust_remote_code, need_weights=False)
    return problems + _data_problems(config.data, ask_hub=False)


def _data_problems(data: DataSection, ask_hub: bool) -> list[str]:
    """``data.train_files`` and ``data.eval_files``: each entry found (``ask_hub``: a Hub dataset's too), a line
    for each one that is not (the whole list at once stopped at its first)."""
    keys = ("train_files", "eval_files")
    return [
        line
        for key in keys
        for name in getattr(data, key)
        for line in _entry_problems(name, f"data.{key}", ask_hub)
    ]


def _entry_problems(name: str, key: str, ask_hub: bool) -> list[str]:
    if not is_hub_dataset(name) and not Path(name).expanduser().exists():
        return [missing_entry(key, name)]  # where a relative one was looked for, as for model.path
    try:
        for entry in resolve_files([name], key):
            if isinstance(entry, HubDataset) and ask_hub:
                hub_check(entry, key)
    except DataError as err:
        return [str(err)]
    return []


def _source_problems(key: str, value: str, trust_remote_code: bool, need_weights: bool) -> list[str]:
    path = Path(value).expanduser()
    if path.exists():
        return _directory_problems(key, path, trust_remote_code, need_weights)
    if _looks_like_path(value):
        return [missing_path(key, value)]
    return _hub_problems(key, value)


def _directory_problems(key: str, path: Path, trust_remote_code: bool, need_weights: bool) -> list[str]:
    if not path.is_dir():
        return [f"{key}: {path} is a file; expected a Hugging Face model directory"]
    if not need_weights:
        if not any((path / name).is_file() for name in _TOKENIZER_FILES):
            return [f"{key}: {path} holds no tokenizer files ({', '.join(_TOKENIZER_FILES)})"]
        return []
    config_file = path / "config.json"
    if not config_file.is_file():
        return [f"{key}: {path} holds no config.json: not a Hugging Face model directory"]
    try:
        model_config = json.loads(config_file.read_text())
    except (OSError, ValueError) as err:
        return [f"{key}: {config_file} is not readable JSON ({err})"]
    problems = []
    model_type = model_config.get("model_type")
    remote = trust_remote_code and "auto_map" in model_config
    if not remote and not _known_model_type(model_type):
        from transformers import __version__

        problems.append(
            f"{key}: {config_file} has model_type {model_type!r}, which transformers {__version__} does not know "
            "(a newer transformers, or model.trust_remote_code=true for a model that ships its code)"
        )
    if not any((path / name).is_file() for name in _WEIGHTS):
        problems.append(f"{key}: {path} holds no weights ({' or '.join(_WEIGHTS[::2])})")
    return problems + _missing_shards(key, path)


def _missing_shards(key: str, path: Path) -> list[str]:
    """The weight files the index transformers loads (safetensors' first) names and the folder lacks: a download
    cut short was a FileNotFoundError traceback at load, after the data was prepared."""
    # transformers' order: a whole model.safetensors before any index, safetensors before .bin
    if (path / "model.safetensors").is_file():
        return []
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        index = path / "pytorch_model.bin.index.json"
        if (path / "pytorch_model.bin").is_file() or not index.is_file():
            return []
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return [f"{key}: {index} is no readable weight index (a JSON object with a weight_map)"]
    missing = sorted(name for name in shards if not (path / name).is_file())
    if not missing:
        return []
    shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
    return [
        f"{key}: {path} lacks {len(missing)} of the {len(shards)} weight files its {index.name} names ({shown}): "
        "a download cut short? (hf download fetches what is missing)"
    ]


def _lora_problems(model_section: ModelSection) -> list[str]:
    """model.lora.target_modules that match no module of the model, or name one peft cannot adapt, and any other
    refusal of peft's (each would fail in peft after the model loaded on every rank).

    The model is built on the meta device from its config.json (no weights read, no memory): only for a local
    directory without remote code; anything else is left to peft.
    """
    lora, path = model_section.lora, Path(model_section.path).expanduser()
    if lora is None or model_section.trust_remote_code or not (path / "config.json").is_file():
        return []
    # Imported here: torch and transformers cost seconds, and only a LoRA run pays them in preflight.
    import torch
    from transformers import AutoConfig

    try:
        with torch.device("meta"):
            base = AutoConfig.from_pretrained(path)
            model = auto_model_class(base).from_config(base)
    except (OSError, ValueError, KeyError):
        return []  # an unloadable config is reported by _source_problems
    # suffixes like q_proj would put adapters in the frozen vision tower too; model.embed_tokens ends like one
    refused = [r for r in (tower_refusal(lora, model), embedding_refusal(lora, model)) if r is not None]
    if refused:
        return refused
    linear = linear_layer_names(model)
    found = {t: [m for _, m in hits] for t, hits in target_matches(list(lora.target_modules), model).items()}
    remapped, peft_refused = _peft_remapped(model, lora)  # after the names above: peft wraps in place
    missing = [t for t, hits in found.items() if not hits and t not in remapped]
    unsupported = sorted(
        {type(m).__name__ for t, hits in found.items() if t not in remapped for m in hits} - PEFT_LAYERS
    )
    problems, where = [], f"{type(model).__name__} ({path}); its linear layers: {', '.join(linear)}"
    if missing:
        problems.append(f"model.lora.target_modules: {', '.join(missing)} match no module of {where}")
    if peft_refused and unsupported:  # an MoE experts block or router, a whole MLP: peft fails after loading
        problems.append(
            f"model.lora.target_modules: peft cannot put adapters on {', '.join(unsupported)} (not a linear "
            f"layer) of {where}"
        )
    elif peft_refused and not missing:  # e.g. lora_dropout on the MoE parameters peft adapts (ParamWrapper)
        problems.append(f"model.lora: peft refuses it for {type(model).__name__} ({path}): {peft_refused}")
    return problems


def _peft_remapped(model: object, lora: object) -> tuple[set[str], str]:
    """The targets peft renames for transformers 5 itself (the experts' ``gate_proj``, ``up_proj``, ``down_proj``
    of Qwen3-MoE, OLMoE, DeepSeek-V3..., Mixtral's ``w1``, ``w2``, ``w3`` and ``gate``: fused parameters or router
    modules now, adapted through ``target_parameters``), and peft's refusal in one line ('' when none), from
    peft itself on the meta model (which it changes in place)."""
    import peft

    from coati_kto.parallel.upstream.noise import quiet_known_warnings

    quiet_known_warnings()  # peft reads a deprecated transformers property as it wraps the model
    config = peft_config(lora, model)
    try:
        peft.get_peft_model(model, config)
        refused = ""
    except ValueError as err:  # its first line: peft prints the refused module's repr below
        refused = str(err).splitlines()[0].rstrip("(").strip() or type(err).__name__
    if isinstance(config.target_modules, str):  # a vision-language model's default: its decoder's modules
        return set(), refused
    return set(lora.target_modules) - set(config.target_modules or ()), refused


def _known_model_type(model_type: object) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return isinstance(model_type, str) and model_type in CONFIG_MAPPING_NAMES


# ---------------------------------------------------------------------------------------------- run state
def _attention_problems(model: ModelSection, plugin: PluginSection) -> list[str]:
    """flash_attention_2 without flash-attn; GPU-only settings on CPU: flex_attention trains only where torch
    has its backward (the policy's first backward raised NotImplementedError on CPU, after the models had
    loaded; no-grad passes run there); fp16's dynamic loss scaler asks ColossalAI's CPU accelerator for a device
    count, which raises."""
    import torch

    out = []
    if model.attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        out.append(  # models/hf.py says the same at load, after prepare (minutes on a large data set)
            "model.attn_implementation flash_attention_2 needs the flash-attn package, which is not installed: "
            "pip install flash-attn --no-build-isolation, or set model.attn_implementation=sdpa"
        )
    if torch.cuda.is_available():
        return out
    if model.attn_implementation == "flex_attention":
        out.append(
            f"model.attn_implementation flex_attention: torch {torch.__version__} has no FlexAttention backward "
            "on CPU, so the policy cannot train here; use sdpa (or eager) on CPU, flex_attention on GPUs"
        )
    if plugin.precision == "fp16":  # ColossalAI's fp16 loss scaler counts CUDA devices: a traceback
        out.append("plugin.precision fp16 needs a GPU (ColossalAI's loss scaler); use bf16 or fp32 on CPU")
    return out


def _output_problems(train: TrainSection, output: OutputSection) -> list[str]:
    out_dir = Path(output.dir)
    existing = out_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return [f"output.dir: {existing} is a file, not a directory"]
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".coati-kto-write-test-"):
            pass
    except OSError as err:
        return [f"output.dir: cannot write in {existing} ({err.strerror or err})"]
    # Before "holds a run": that run is alive, and resuming it now would race it. Launcher side only (no RANK):
    # in a rank, its own rank 0 may hold the lock already; there train's claim_output_dir decides.
    holder = lock_holder(out_dir) if "RANK" not in os.environ else None
    if holder is not None:
        return [in_use(out_dir, holder)]
    if starts_from_zero(train, output) and not output.overwrite and previous_run(out_dir):
        found = ", ".join(previous_run(out_dir)[-3:])
        if train.resume == "auto":  # asked to continue, but that run left no checkpoint to continue from
            return [
                f"output.dir: {out_dir} holds a run ({found}) with no complete checkpoint, so train.resume=auto "
                "has nothing to continue: start over with output.overwrite=true (deletes its events and final "
                "model), or use another output.dir"
            ]
        return [
            f"output.dir: {out_dir} already holds a run ({found}): continue it with train.resume=auto, "
            "or start over with output.overwrite=true (deletes its checkpoints, events, final model and exports)"
        ]
    return []


def push_problems(output: OutputSection, exporting: bool = False) -> list[str]:
    """output.push_to_hub that cannot succeed at the end of the run: said now, not after hours of training
    (``exporting``: for ``coati-kto export --push``, which writes its own directory)."""
    push = output.push_to_hub
    if push is None:
        return ["coati-kto export --push needs output.push_to_hub (the repo id)"] if exporting else []
    if not output.save_final and not exporting:
        return [
            f"output.push_to_hub {push.repo_id} with output.save_final false: there is no final/ to upload"
        ]
    if hub_offline():
        return [f"output.push_to_hub {push.repo_id}: {offline_name()} is set, so nothing can be uploaded"]
    if hub_token() is None and os.environ.get("RANK", "0") == "0":  # only global rank 0 uploads
        return [
            f"output.push_to_hub {push.repo_id}: no Hugging Face token (set HF_TOKEN, or run `hf auth login`): "
            "the upload at the end of the run would fail"
        ]
    return []
