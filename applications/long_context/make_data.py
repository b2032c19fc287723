"""Synthetic agent traces of about 8k tokens with the verdict on the last turn: the long-feedback shape of issue 47.

Each record's prompt is one task and a long trajectory of tool calls and their outputs (a log search: many
``grep`` calls whose outputs list log lines, one of which names the failing service); the completion is the
agent's final answer. Desirable: the answer names the service the trace found; undesirable: another service.
A tiny random model learns nothing from 32 of them; the point is that a row this long trains on 2 CPU processes,
each holding half of every row's tokens (plugin.sp_size 2).
"""

from __future__ import annotations

import random
from pathlib import Path

from coati_kto.data.files import write_jsonl

SERVICES = ["auth", "billing", "search", "gateway", "storage", "mailer", "scheduler", "ledger"]
LEVELS = ["INFO", "DEBUG", "WARN"]


def trace(rng: random.Random, failing: str, calls: int) -> str:
    """A task and ``calls`` tool calls with their outputs; one output holds the ERROR line naming ``failing``."""
    lines = ["Task: find the service that failed during last night's deploy and report it."]
    hit = rng.randrange(calls)
    for call in range(calls):
        service = rng.choice(SERVICES)
        lines.append(
            f'<tool_call>{{"name": "grep_logs", "arguments": {{"service": "{service}", "page": {call}}}}}</tool_call>'
        )
        for row in range(6):
            level = "ERROR" if call == hit and row == 3 else rng.choice(LEVELS)
            name = failing if level == "ERROR" else service
            lines.append(
                f"<tool_output>{level} {name} request {rng.randrange(10**6)} took {rng.randrange(999)} ms</tool_output>"
            )
    return "\n".join(lines)


def records(n: int, calls: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        failing = rng.choice(SERVICES)
        desirable = i % 2 == 0
        named = failing if desirable else rng.choice([s for s in SERVICES if s != failing])
        out.append(
            {
                "prompt": trace(rng, failing, calls),
                "completion": f"The failing service is {named}: its ERROR line is in the logs above.",
                "label": desirable,
            }
        )
    return out


def write(out_dir: Path, n: int = 16, calls: int = 19, seed: int = 0) -> Path:
    """``n`` records of ``calls`` tool calls each into ``out_dir``/traces.jsonl."""
    return write_jsonl(records(n, calls, seed), out_dir / "traces.jsonl")
