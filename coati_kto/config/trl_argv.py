"""Reading a command line that holds TRL's flags: which tokens are TRL's flags (``--name value``, as
HfArgumentParser reads them) and which are the command's own options (``--nproc-per-node 2``, ``--push``), kept
as given for the command ``coati_kto.config.trl_flags`` suggests.
"""

from __future__ import annotations

from coati_kto.config.trl_names import BOOLEAN, KNOWN, LIST_FLAGS

# The options of the commands that take a config (coati_kto/cli.py): they are theirs, not TRL's.
COMMAND_OPTIONS = frozenset(
    ("help", "ranks", "batches", "examples", "nproc-per-node", "checkpoint", "out", "push", "schema")
    + ("gpus", "gpu-memory", "nodes")
)
# Those of them that take no value (argparse's store_true, --help).
BARE_OPTIONS = frozenset(("help", "push", "schema"))
CONFIG_COMMANDS = ("prepare", "inspect", "train", "precompute", "export", "plan", "config")
_BOOL_WORDS = {"true", "false", "1", "0", "yes", "no"}


def truth(value: str | None) -> bool | None:
    """A bare flag is true; a boolean word is its value; anything else None."""
    if value is None:
        return True
    return value.lower() in ("true", "1", "yes") if value.lower() in _BOOL_WORDS else None


def as_float(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _own_span(argv: list[str], i: int) -> int:
    """How many tokens from ``argv[i]`` are one of the command's own options with its value (0: none)."""
    raw, sep, _ = argv[i].removeprefix("--").partition("=")
    if not argv[i].startswith("--") or raw not in COMMAND_OPTIONS:
        return 0
    takes = not sep and raw not in BARE_OPTIONS and i + 1 < len(argv)
    return 1 + takes


def own_options(argv: list[str]) -> tuple[list[str], set[int]]:
    """The command's own options as given, each with its value, in order; and the positions they take."""
    out: list[str] = []
    taken: set[int] = set()
    i = 0
    while i < len(argv):
        span = _own_span(argv, i) or 1
        if _own_span(argv, i):
            out += argv[i : i + span]
            taken.update(range(i, i + span))
        i += span
    return out, taken


def read_flags(argv: list[str]) -> list[tuple[str, str | None]]:
    """Every ``--name value`` / ``--name=value`` / bare ``--name`` that is not an option of the command, in order,
    named as TRL spells it (``canonical``); a list-valued flag's values (``--report_to wandb tensorboard``) are
    one value, joined by spaces."""
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        raw, sep, value = argv[i].removeprefix("--").partition("=")
        if (span := _own_span(argv, i)) or not argv[i].startswith("--"):
            i += span or 1
            continue
        name, negated = canonical(raw)
        if negated:  # HfArgumentParser's --no_X stores false and takes no value
            value = "false"
        elif not sep:
            following = argv[i + 1] if i + 1 < len(argv) else None
            # a negative number is a value (transformers' --max_steps -1), not a flag
            takes = following is not None and (
                not following.startswith("-") or as_float(following) is not None
            )
            if name in BOOLEAN:
                takes = takes and following.lower() in _BOOL_WORDS
            elif name not in KNOWN or name in LIST_FLAGS:  # neither may take the config or an override
                takes = takes and _not_positional(following)
            value, i = (following, i + 1) if takes else (None, i)
        # nargs="+": the values up to the next option, override or config (dropped after the first, they vanished)
        while name in LIST_FLAGS and value is not None and i + 1 < len(argv) and _list_value(argv[i + 1]):
            value, i = f"{value} {argv[i + 1]}", i + 1
        out.append((name, value))
        i += 1
    return out


def canonical(raw: str) -> tuple[str, bool]:
    """A flag's name as TRL spells it, and whether it was a ``--no_X``: HfArgumentParser takes ``--warmup-ratio``
    for ``--warmup_ratio`` and ``--no_X`` / ``--no-X`` for ``--X false`` (read here for every boolean X). A name
    TRL does not know is kept as given."""
    name = raw.replace("-", "_")
    if name.startswith("no_") and name[3:] in BOOLEAN:
        return name[3:], True
    return (name, False) if name in KNOWN else (raw, False)


def _not_positional(token: str) -> bool:
    """Whether ``token`` can be a flag's value: not an override (``KEY=VALUE``) or the config file."""
    return "=" not in token and not token.endswith((".yaml", ".yml"))


def _list_value(token: str) -> bool:
    return not token.startswith("-") and _not_positional(token)
