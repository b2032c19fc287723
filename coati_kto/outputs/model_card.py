"""``final/README.md``: a Hugging Face model card for the exported model, so the directory can be shared as is.

YAML front matter (library_name, base_model when it is a Hub id, tags, datasets when they are Hub ids), then
the base model, the data (files, counts per label, truncation), the KTO and training settings and the final
evaluation metrics. ``render`` is the one entry point that reads the whole config (the card embeds it); each
section of the card reads the config sections it shows. No collective, no I/O but the base model's config.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from coati_kto.config.hub import hub_id, is_hub_dataset
from coati_kto.config.kto import KTOSection
from coati_kto.config.output import OutputSection
from coati_kto.config.schema import Config, DataSection, ModelSection, PluginSection, TrainSection
from coati_kto.runtime.durable import write_file
from coati_kto.trainer.loss import needs_kl
from coati_kto.trainer.run_summary import data_stats_table, split_rows

CARD = "README.md"  # the card's file name in an export directory
EVAL_KEYS = (
    "eval/loss",
    "eval/rewards/chosen",
    "eval/rewards/rejected",
    "eval/rewards/margins",
    "eval/logps/chosen",
    "eval/logps/rejected",
    "eval/kl",
    "eval/kl_raw",
    "eval/count/chosen",
    "eval/count/rejected",
)


def write_card(directory: Path, card: str) -> Path:
    """``card`` as ``directory/README.md``, on disk (file and directory entry) before this returns, and never
    seen half-written: the card is written last and marks an export finished (``outputs.export.finished_final``),
    so a node crash must not leave a truncated or lost card beside synced weights. Returns its path."""
    path = directory / CARD
    write_file(path, card)
    return path


def last_eval(history: Any) -> dict[str, float] | None:
    """The last evaluation record of a KTOTrainer history ({"step": ..., "eval/loss": ..., ...}) or None; a
    non-finite evaluation's record holds no means, only ``eval/nonfinite_examples`` and what stays finite."""
    records = [h for h in history if any(str(key).startswith("eval/") for key in h)]
    return dict(records[-1]) if records else None


def base_model_id(model: ModelSection) -> str | None:
    """The base model's Hub id: model.path itself, or for a local directory its config's ``_name_or_path``."""
    found = hub_id(model.path)
    if found is None:
        cfg = Path(model.path) / "config.json"
        if cfg.is_file():
            found = hub_id(json.loads(cfg.read_text()).get("_name_or_path"))
    return found


def _fmt(key: str, value: float) -> str:
    """Counts as integers; other metrics exactly as logged (shortest round-trip repr)."""
    return str(int(value)) if key.startswith("eval/count/") else repr(float(value))


def render(
    config: Config,
    data_stats: dict[str, Any] | None,
    eval_record: dict[str, float] | None,
    steps: int,
    weights: tuple[float, float],
    world_size: int,
    notes: list[str] | None = None,
) -> str:
    """The card's text (front matter + markdown). ``weights``: the (lambda_D, lambda_U) the run used;
    ``notes``: the one-line facts the run printed about choices made for the user (the attention kernel, the
    pad token, settings changed on resume, the exported dtype), repeated here so the card says what was used."""
    model, data = config.model, config.data
    lines = [
        *_front_matter(model, data, config.kto.loss_type, Path(config.training_output().dir).name),
        *_data_section(data, data_stats),
        *_settings_section(config.kto, weights),
        *_training_section(config.train, config.plugin, steps, world_size, notes or []),
        *_evaluation_section(eval_record, bool(data_stats and data_stats.get("eval"))),
        *_use_section(model, config.training_output()),
        *_config_section(config.to_yaml()),
    ]
    return "\n".join(lines)


# The Hub's task for the class the Use section loads (a vision-language export reads images too).
PIPELINE_TAGS = {"AutoModelForImageTextToText": "image-text-to-text"}


def _front_matter(model: ModelSection, data: DataSection, loss_type: str, title: str) -> list[str]:
    from huggingface_hub import ModelCardData  # imported by the one rank that writes the card

    base = base_model_id(model)
    datasets = sorted({d for f in data.train_files + data.eval_files if (d := _dataset_id(f))})
    tags = ["kto", "coati-kto", "colossalai", loss_type.replace("_", "-")]
    meta = ModelCardData(
        library_name="transformers",
        base_model=base,
        tags=sorted(set(tags)),
        datasets=datasets or None,
        pipeline_tag=PIPELINE_TAGS.get(_auto_class_name(model), "text-generation"),
    )
    return [
        "---",
        meta.to_yaml(),
        "---",
        "",
        f"# {title}",
        "",
        f"Aligned from binary feedback with coati-kto (loss `{loss_type}`) on ColossalAI.",
        "",
        "## Base model",
        "",
        f"`{model.path}`" + (f" (Hub id `{base}`)" if base and base != model.path else ""),
        "",
    ]


def _data_section(data: DataSection, data_stats: dict[str, Any] | None) -> list[str]:
    lines = ["## Data", ""]
    if data_stats is None:
        return [*lines, "- train files: " + ", ".join(f"`{f}`" for f in data.train_files), ""]
    for row in split_rows(data_stats):
        files = ", ".join(f"`{f}`" for f in row["files"])
        held_out = f"held out of the train files by prompt (data.eval_fraction {data.eval_fraction})"
        lines.append(f"- {row['split']} files: {files or held_out}")
    return [
        *lines,
        "",
        data_stats_table(data_stats),
        "",
        f"Truncation: data.max_length {data.max_length}, data.max_prompt_length {data.max_prompt_length}.",
        "",
        *_completions(data_stats.get("completion_end")),
    ]


def _completions(line: str | None) -> list[str]:
    """How completions end, from prepare's line (stats.json's ``completion_end``): its no-EOS ``warning:`` (a
    command-line warning with its fix) stated as what the model is."""
    if not line:
        return []
    # Here, not at the top: data.endings imports transformers; the card is rendered once a run has loaded it.
    from coati_kto.data.endings import NO_EOS, NO_EOS_WARNING

    # The warning comes first; any other ending follows it ("; completions end with the template's ...").
    if line.startswith(NO_EOS_WARNING):
        return [f"Completions end with no end-of-sequence token: {NO_EOS}{line[len(NO_EOS_WARNING) :]}.", ""]
    return [f"Completions: {line}.", ""]


def _settings_section(kto: KTOSection, weights: tuple[float, float]) -> list[str]:
    return [
        "## KTO settings",
        "",
        "| setting | value |",
        "| --- | --- |",
        f"| loss_type | {kto.loss_type} |",
        f"| beta | {kto.beta} |",
        f"| desirable_weight (lambda_D) | {weights[0]:.6g} |",
        f"| undesirable_weight (lambda_U) | {weights[1]:.6g} |",
        f"| kl_scope | {kto.kl_scope if needs_kl(kto.loss_type) else 'n/a (no reference point)'} |",
        "",
    ]


def _training_section(
    train: TrainSection, plugin: PluginSection, steps: int, world_size: int, notes: list[str]
) -> list[str]:
    return [
        "## Training",
        "",
        f"{steps} optimizer steps; lr {train.lr} (warmup {train.warmup_steps}, cosine to "
        f"{train.min_lr_ratio} x lr); {_batch(train, plugin, world_size)}; plugin {plugin.name} "
        f"(ZeRO {plugin.zero_stage}, {plugin.precision}, tp {plugin.tp_size}); "
        f"seed {train.seed}. The whole resolved config is at the end of this card.",
        "",
        *[f"- {note}" for note in notes],
        *([""] if notes else []),
    ]


def _evaluation_section(eval_record: dict[str, float] | None, has_eval_split: bool) -> list[str]:
    lines = ["## Evaluation", ""]
    if eval_record is None and has_eval_split:
        why = (
            "No evaluation ran in the process that wrote this card (a resume or `coati-kto export` after the "
            "last one, or evaluation turned off): see TensorBoard's eval/ scalars for any earlier ones."
        )
        return [*lines, why, ""]
    if eval_record is None:
        return [*lines, "No evaluation set was configured (data.eval_files / data.eval_fraction).", ""]
    if eval_record.get("eval/nonfinite_examples"):
        bad = (
            f"The last evaluation, at optimizer step {int(eval_record['step'])}, was non-finite (NaN/inf) in "
            f"{eval_record['eval/nonfinite_examples']:.0f} of its examples: no means were taken "
            "(`eval/nonfinite_examples`; the run's log names the values). See TensorBoard's eval/ scalars for the "
            "evaluations before it."
        )
        return [*lines, bad, ""]
    return [
        *lines,
        f"On the evaluation split, at optimizer step {int(eval_record['step'])}:",
        "",
        "| metric | value |",
        "| --- | ---: |",
        *[f"| {k} | {_fmt(k, eval_record[k])} |" for k in EVAL_KEYS if k in eval_record],
        "",
    ]


def _auto_class_name(model: ModelSection) -> str:
    """The Auto class that reloads the export: image-text-to-text for a vision-language base model (read from a
    local model directory; a hub id gets the causal-LM class)."""
    if not (Path(model.path) / "config.json").is_file():
        return "AutoModelForCausalLM"
    from transformers import AutoConfig

    from coati_kto.families import auto_model_class

    base = AutoConfig.from_pretrained(model.path, trust_remote_code=model.trust_remote_code)
    return auto_model_class(base).__name__


def _has_processor(model: ModelSection) -> bool:
    """Whether ``model.path`` holds a processor's files, which the export copies (``trainer.export``)."""
    from coati_kto.models.hf import PROCESSOR_FILES

    return any((Path(model.path) / name).is_file() for name in PROCESSOR_FILES[:3])


def _without_torchvision(model: ModelSection) -> list[str]:
    """For a family whose hub processor lists a video processor (coati_kto.data.processors): AutoProcessor
    needs torchvision there; the line that loads the image part without it."""
    from coati_kto.data.processors import HUB_CLASS

    config = json.loads((Path(model.path) / "config.json").read_text())
    if config.get("model_type") not in HUB_CLASS:
        return []
    return [
        "# AutoProcessor needs torchvision here (this family's processor lists a video processor); without it:",
        '# from coati_kto.data.processors import load_processor_for_images; load_processor_for_images("path/to/final")',
    ]


def _use_section(model: ModelSection, output: OutputSection) -> list[str]:
    auto = _auto_class_name(model)
    # A vision-language export with its processor (image records): the processor reads images and text.
    reader = (
        "AutoProcessor"
        if auto == "AutoModelForImageTextToText" and _has_processor(model)
        else "AutoTokenizer"
    )
    lines = ["## Use", "", "```python", f"from transformers import {auto}, {reader}", ""]
    if model.lora is None:
        name = "processor" if reader == "AutoProcessor" else "tokenizer"
        lines += [
            f'model = {auto}.from_pretrained("path/to/final")',
            f'{name} = {reader}.from_pretrained("path/to/final")',
        ]
        lines += _without_torchvision(model) if reader == "AutoProcessor" else []
    else:  # coati_kto.models.lora.export_lora: final/adapter (peft) and, with output.merge_lora, final/merged
        lora = model.lora
        # A vision-language model's default targets are its language model's (coati_kto.config.lora.peft_targets);
        # final/adapter and final/merged hold the processor's files beside the tokenizer's (models.lora).
        scope = " of the language model" if auto == "AutoModelForImageTextToText" else ""
        reads = (
            'processor = AutoProcessor.from_pretrained("path/to/final/adapter")'
            if reader == "AutoProcessor"
            else 'tokenizer = AutoTokenizer.from_pretrained("path/to/final/adapter")'
        )
        lines += [
            "from peft import PeftModel",
            "",
            f"# LoRA adapters (rank {lora.rank}, alpha {lora.alpha:g}) on {', '.join(lora.target_modules)}{scope}",
            f'model = PeftModel.from_pretrained({auto}.from_pretrained("{model.path}"), "path/to/final/adapter")',
            reads,
        ]
        if output.merge_lora:
            lines += [f'# or, merged: {auto}.from_pretrained("path/to/final/merged")']
    return [*lines, "```", ""]


def _config_section(config_yaml: str) -> list[str]:
    # Embedded, not linked: the card travels with final/ (uploaded alone), the run's config.yaml does not.
    return [
        "## Configuration",
        "",
        "<details><summary>The resolved config of the run (every default filled in)</summary>",
        "",
        "```yaml",
        config_yaml.rstrip(),
        "```",
        "",
        "</details>",
        "",
    ]


def _dataset_id(entry: str) -> str | None:
    """The Hub dataset an entry of data.*_files names (``hf://datasets/OWNER/NAME?...``, or a bare hub id)."""
    if is_hub_dataset(entry):
        return entry.removeprefix("hf://datasets/").partition("?")[0]
    return hub_id(entry)


def _batch(train: TrainSection, plugin: PluginSection, world_size: int) -> str:
    """The examples per optimizer step as they multiply out: tensor-, sequence-parallel peers and pipeline stages
    share their data-parallel rank's micro-batches, so only the data-parallel ranks multiply."""
    dp = max(1, world_size // (plugin.tp_size * plugin.sp_size * plugin.pp_size))
    m, a = train.micro_batch_size, train.accumulation_steps
    return (
        f"micro-batch {m} x accumulation {a} x {dp} data-parallel rank(s) = {m * a * dp} examples per step, "
        f"on {world_size} process(es)"
    )
