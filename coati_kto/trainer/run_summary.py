"""What a run was, as text: the resolved config and the prepared data's statistics (TensorBoard, model card).

Pure functions of the resolved config (``Config.model_dump(mode="json")``) and ``stats.json`` (written by
``coati_kto.data.store``, with ``imbalance`` from ``coati_kto.data.weights``); no I/O, callable on any rank.
"""

from __future__ import annotations

from typing import Any

import yaml


def _code_block(text: str) -> str:
    """Markdown code block by indentation (TensorBoard's text plugin renders it verbatim)."""
    return "\n".join("    " + line for line in text.rstrip("\n").splitlines())


def config_markdown(run_config: dict[str, Any]) -> str:
    """The resolved config (every default filled in) as a YAML code block."""
    return _code_block(yaml.safe_dump(run_config, sort_keys=False))


def split_rows(stats: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per prepared split: examples, label counts, truncation and drops (stats.json's numbers)."""
    rows = []
    for name in ("train", "eval"):
        split = stats.get(name)
        if not split:
            continue
        truncated = split.get("truncated", {})
        rows.append(
            {
                "split": name,
                "files": (stats.get("files") or {}).get(name) or [],
                "examples": split["examples"],
                "desirable": split["labels"]["desirable"],
                "undesirable": split["labels"]["undesirable"],
                "truncated_prompts": truncated.get("prompt", 0),
                "truncated_completions": truncated.get("completion", 0),
                # A KL row joins the prompt with another example's completion: cut to fit whatever the policy.
                "kl_rows_cut": f"{truncated.get('kl_prompt', 0)} / {truncated.get('kl_completion', 0)}",
                "dropped_to_fit": sum((split.get("dropped") or {}).values()),
            }
        )
    return rows


def data_stats_table(stats: dict[str, Any]) -> str:
    """A markdown table of :func:`split_rows` and the skipped bad records."""
    lines = [
        "| split | examples | desirable | undesirable | truncated prompts | truncated completions "
        "| KL rows cut (prompts / completions) | dropped to fit |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in split_rows(stats):
        lines.append(
            f"| {r['split']} | {r['examples']} | {r['desirable']} | {r['undesirable']} | "
            f"{r['truncated_prompts']} | {r['truncated_completions']} | {r['kl_rows_cut']} | "
            f"{r['dropped_to_fit']} |"
        )
    bad = (stats.get("bad_records") or {}).get("skipped", 0)
    lines.append("")
    lines.append(f"Bad records skipped: {bad}.")
    return "\n".join(lines)


def data_stats_markdown(stats: dict[str, Any]) -> str:
    """Files, per-split counts per label, truncation and drops, the imbalance report and the fingerprint."""
    lines = []
    for r in split_rows(stats):
        files = ", ".join(f"`{f}`" for f in r["files"]) or "held out of the train files (data.eval_fraction)"
        lines.append(f"**{r['split']} files:** {files}")
        lines.append("")
    lines.append(data_stats_table(stats))
    report = (stats.get("imbalance") or {}).get("report")
    if report:
        lines += ["", report]
    if stats.get("fingerprint"):
        lines += ["", f"Prepared data fingerprint: `{stats['fingerprint']}`."]
    return "\n".join(lines)


def flat_hparams(run_config: dict[str, Any]) -> dict[str, float | int | str | bool]:
    """``{"kto.beta": 0.1, ...}``: every leaf of the config as a scalar the HPARAMS tab accepts.

    Lists become comma-joined strings and None the string "null" (the plugin takes no None).
    """
    flat: dict[str, float | int | str | bool] = {}
    for section, values in run_config.items():
        for key, value in (values or {}).items():
            if value is None:
                value = "null"
            elif isinstance(value, list | tuple):
                value = ",".join(str(v) for v in value)
            elif isinstance(value, dict):
                value = yaml.safe_dump(value, default_flow_style=True).strip()
            flat[f"{section}.{key}"] = value
    return flat
