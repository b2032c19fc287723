"""What ``prepare`` prints of a build's stats.json: built or reused, then counts, lengths, cuts and drops per
split, and what the records held that was not read. Any process, no side effects."""

from __future__ import annotations

from coati_kto.config.schema import DataSection
from coati_kto.data.image_store import image_summary


def summary(stats: dict, data: DataSection, built: bool, why: str, seconds: float) -> str:
    """A short human summary of stats.json: built or reused, then counts, lengths and drops per split."""
    target = data.prepared_dir
    lines = []
    if built:
        n = sum((stats[s] or {}).get("examples", 0) for s in ("train", "eval"))
        lines.append(f"prepared {target} ({why}) in {seconds:.1f} s, {n / max(seconds, 1e-9):.0f} examples/s")
    else:
        lines.append(f"reusing {target} ({why}; fingerprint {stats['fingerprint']})")
    for name in ("train", "eval"):
        if stats.get(name):
            lines += _split_summary(name, stats[name], data.max_length)
    if stats.get("completion_end"):
        lines.append(f"  {stats['completion_end']}")
    if day := stats.get("template_date"):
        lines.append(
            f"  the chat template dates each prompt (strftime_now): rendered as of {day}, the build's day; a "
            "rebuild on another day renders other prompts and a resume across it is refused (a template "
            "variable may pin it: Llama 3's data.chat_template_kwargs.date_string)"
        )
    if unread := stats.get("unread_fields"):
        lines.append(unread_line(unread))
    dup = stats["duplicates"]
    if dup["records"]:
        lines.append(
            f"  duplicates: {dup['records']} records repeat an earlier one exactly (same prompt, completion and "
            f"label; e.g. {dup['examples'][0]}); kept: remove them if you did not mean them"
        )
    if stats["padding"]["note"]:
        lines.append(f"  {stats['padding']['note']}")
    bad = stats["bad_records"]
    if bad["skipped"]:
        lines.append(
            f"  bad records skipped: {bad['skipped']} ({_counts(bad['by_reason'])}; all in {target}/skipped.txt)"
        )
    return "\n".join(lines)


def unread_line(unread: dict[str, int]) -> str:
    """The summary's line on the fields no record shape reads: the first 8 named, the rest counted."""
    shown = ", ".join(f"{name} ({count} records)" for name, count in list(unread.items())[:8])
    if len(unread) > 8:  # every one is in stats.json
        shown += f", and {len(unread) - 8} more (stats.json's unread_fields lists them all)"
    return (
        f"  fields not read: {shown}; only prompt, completion, label, messages/conversations, chosen/rejected "
        "and tools are (a system prompt goes in as a system message)"
    )


def _counts(by_reason: dict[str, int]) -> str:
    """``too_long 2, no_room_for_completion 3`` (a reason's count), or ``none``."""
    return ", ".join(f"{reason} {n}" for reason, n in by_reason.items()) or "none"


def _split_summary(name: str, s: dict, max_length: int) -> list[str]:
    """The summary's lines for one split's stats."""
    lines = []
    lab, tot, tr = s["labels"], s["lengths"]["total"], s.get("truncated", {})
    cut = s["lengths_truncated"]["total"]
    lines.append(
        f"  {name}: {s['examples']} examples ({lab['desirable']} desirable, {lab['undesirable']} "
        f"undesirable); tokens per example before truncation p50 {tot['p50']:.0f}, p99 {tot['p99']:.0f}, "
        f"max {tot['max']}; after p50 {cut['p50']:.0f}, p99 {cut['p99']:.0f}, max {cut['max']}"
    )
    lines.append(
        f"    truncated to data.max_length {max_length}: {tr.get('prompt', 0)} prompts, "
        f"{tr.get('completion', 0)} completions; dropped: {_counts(s['dropped'])}"
        f"{' (each named in skipped.txt)' if s['dropped'] else ''}; "
        f"KL pairs: {s['kl_pairs']['self_pairs']} self, {s['kl_pairs']['same_prompt_pairs']} same-prompt "
        f"(minimum possible {s['kl_pairs']['min_same_prompt_pairs']})"
        + (  # plain-text and message records pair within their kind; a kind of one example cannot
            f", {s['kl_pairs']['cross_format_pairs']} across plain-text and message records (a kind with one "
            "example has no partner of its own)"
            if s["kl_pairs"].get("cross_format_pairs")
            else ""
        )
    )
    kl_cut = (tr.get("kl_prompt", 0), tr.get("kl_completion", 0))
    if any(kl_cut):
        lines.append(
            f"    KL rows cut to data.max_length {max_length}: {kl_cut[0]} prompts, {kl_cut[1]} "
            "completions (a KL row joins one example's prompt with another's completion and is cut to "
            "fit, whatever data.on_too_long does with the examples)"
        )
    if line := image_summary(s):
        lines.append(line)
    if (stops := s.get("stop_inside_completion") or {}).get("rows"):  # none in builds before 2026-12-01
        lines.append(
            f"    warning: {stops['rows']} completions hold a token that ends generation before their end (e.g. "
            f"{stops['first']}): the tokens after it are trained though generation stops there (a control token "
            "written in the record's text, or a completion of several assistant turns)"
        )
    if s["boundary_inside_token"]:
        lines.append(
            f"    {s['boundary_inside_token']} examples have one token spanning the prompt/completion "
            "boundary (a prompt ending in a space: the token is trained on as the completion's first; a "
            "completion starting with whitespace: the token stays with the prompt, the whitespace untrained)"
        )
    return lines
