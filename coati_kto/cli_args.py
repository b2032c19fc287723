"""``coati-kto``'s command line: the commands and their options (argparse), read into a Namespace whose
``overrides`` hold every ``section.key=value``. Nothing heavy is imported here: ``--help`` and ``config`` must not
pay for torch."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn

from coati_kto.errors import USER_ERROR_EXIT_CODE, UserError, without_secrets

_EPILOG = "Overrides: section.key=value (YAML values), e.g. train.lr=1e-6 data.max_length=512"


class _OneLineParser(argparse.ArgumentParser):
    """argparse with its mistakes as one ``error:`` line and exit 2, as every other user mistake (argparse printed
    its usage block, and an unknown option after a command the top-level usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(
            USER_ERROR_EXIT_CODE, f"error: {self.prog}: {message} ({self.prog} --help lists its options)\n"
        )


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="coati-kto", description="KTO training from binary feedback on ColossalAI.", epilog=_EPILOG
    )
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=_EPILOG)
        p.add_argument("config", help="YAML config file")
        p.add_argument("overrides", nargs="*", default=[], help="section.key=value")  # default: not required
        return p

    command("prepare", "Tokenize and validate the data, build KL pairs, save to data.prepared_dir.")
    p = command("inspect", "Show each rank's first micro-batches, label mix and decoded examples.")
    p.add_argument("--ranks", type=int, default=None, help="data-parallel ranks (default: 1)")
    p.add_argument("--batches", type=int, default=4, help="micro-batches to show per rank (default: 4)")
    p.add_argument("--examples", type=int, default=3, help="decoded examples to show (default: 3)")
    p = command("train", "Train (run under torchrun / colossalai run, or use --nproc-per-node).")
    p.add_argument(
        "--nproc-per-node", type=int, default=None, help="launch this many local processes with torchrun"
    )
    # ---- precompute (reference log-probs cache; coati_kto.recipe.precompute)
    p = command(
        "precompute",
        "Score every example and KL pair with the reference model once; store with the prepared data "
        "(used by kto.reference=cached).",
    )
    p.add_argument(
        "--nproc-per-node", type=int, default=None, help="launch this many local processes with torchrun"
    )
    # ---- end precompute
    export = "Write a checkpoint of the run as a Hugging Face model (as training does at its end), e.g. to evaluate "
    _export_options(command("export", export + "a run part-way; output.dir is only read."))
    _plan_command(command)
    p = sub.add_parser(
        "config",
        help="Print the resolved config (every default filled in), or with --schema every key.",
        description="Print CONFIG with OVERRIDES applied and every default filled in, as YAML; or, with "
        "--schema, every key with its type, default and help.",
        epilog=_EPILOG,
    )
    p.add_argument("config", nargs="?", help="YAML config file")
    p.add_argument("overrides", nargs="*", default=[], help="section.key=value")
    p.add_argument("--schema", action="store_true", help="list every key: type, default, help")
    p = sub.add_parser(
        "tiny-model",
        help="Write a tiny random Llama with a ChatML tokenizer into DIR (to try the commands on a CPU).",
        description="Write a tiny random Llama with a ChatML tokenizer into DIR, Hugging Face format: a model "
        "that knows nothing, to try the commands on a CPU in seconds (model.path=DIR).",
    )
    p.add_argument("dir", help="the folder to write (new, or one an earlier tiny-model wrote)")
    p.add_argument("--seed", type=int, default=0, help="the weights' seed")
    p.add_argument("--hidden-size", type=int, default=64, help="a multiple of 4 (4 attention heads)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers")
    p.set_defaults(overrides=[])
    return parser


def _export_options(p: argparse.ArgumentParser) -> None:
    """``coati-kto export``'s own options."""
    p.add_argument(
        "--checkpoint",
        default="auto",
        help="auto (the latest complete one) or a checkpoints/step-N directory",
    )
    p.add_argument("--out", default=None, help="where to write it (default: output.dir/exports/step-N)")
    p.add_argument(
        "--push",
        action="store_true",
        help="upload to output.push_to_hub: final/ as the run left it (no --checkpoint/--out), else this export",
    )
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="launch this many local processes with torchrun (the checkpoint's layout: exact fp32 masters)",
    )


def _plan_command(command: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """``coati-kto plan`` and its own options: the cluster it plans for."""
    p = command(
        "plan",
        "Per-rank memory of the configured layout (weights, gradients, optimizer states, reference, "
        "activations, buffers) and the layouts that fit; reads the model's config.json only.",
    )
    p.add_argument("--gpus", type=int, default=None, help="GPUs in all (default: one data-parallel replica)")
    p.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU (default: 80)")
    p.add_argument("--nodes", type=int, default=1, help="nodes the GPUs are spread over (default: 1)")


def version_line() -> str:
    """``coati-kto X (colossalai Y, torch Z, transformers W)``, from package metadata (nothing imported)."""
    from importlib.metadata import PackageNotFoundError, version

    from coati_kto import __version__

    parts = []
    for name in ("colossalai", "torch", "transformers"):
        try:
            parts.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            parts.append(f"{name} not installed")
    return f"coati-kto {__version__} ({', '.join(parts)})"


def parse(argv: list[str] | None) -> argparse.Namespace:
    """argparse cannot take positional overrides after options (``--ranks 2 train.seed=1``): collect them. TRL's
    flags (``--model_name_or_path M``) are one line naming the overrides they mean, before argparse reads them
    (it would take M for the config file)."""
    parser = _parser()
    argv = sys.argv[1:] if argv is None else argv
    if any(a.startswith("--") and a not in ("--help", "--version") for a in argv):  # --help: no config import
        from coati_kto.config.trl_flags import trl_flags_line

        if (line := trl_flags_line(argv)) is not None:
            parser.exit(USER_ERROR_EXIT_CODE, f"error: {without_secrets(line)}\n")
    args, extra = parser.parse_known_args(argv)
    unknown = [item for item in extra if item.startswith("-") or "=" not in item]
    if unknown:  # named with the command's own options, not the top level's
        command = f"coati-kto {args.command}"
        parser.exit(
            USER_ERROR_EXIT_CODE,
            f"error: {command}: unrecognized arguments: {' '.join(unknown)} ({command} --help lists its options)\n",
        )
    args.overrides = [*args.overrides, *extra]
    return args


def check_numbers(args: argparse.Namespace) -> None:
    """Command-line counts must be >= 1 (argparse checks only that they are integers)."""
    for option in ("ranks", "batches", "nproc_per_node"):
        value = getattr(args, option, None)
        if value is not None and value < 1:
            raise UserError(f"--{option.replace('_', '-')} must be >= 1, got {value}")
    if getattr(args, "out", None) == "":  # it read as "no --out": the default target, in silence
        raise UserError("--out needs a directory, got ''")
    if getattr(args, "examples", None) is not None and args.examples < 0:
        raise UserError(f"--examples must be >= 0, got {args.examples}")
