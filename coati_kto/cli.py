"""``coati-kto`` (also ``python -m coati_kto``): prepare | inspect | train | precompute.

User mistakes (UserError) print one ``error:`` line and exit 2, with no traceback.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from coati_kto.errors import UserError

_EPILOG = "Overrides: section.key=value (YAML values), e.g. train.lr=1e-6 data.max_length=512"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="coati-kto", description="KTO training from binary feedback on ColossalAI.", epilog=_EPILOG
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=_EPILOG)
        p.add_argument("config", help="YAML config file")
        p.add_argument("overrides", nargs="*", help="section.key=value")
        return p

    command("prepare", "Tokenize and validate the data, build KL pairs, save to data.prepared_dir.")
    p = command("inspect", "Show each rank's first micro-batches, label mix and decoded examples.")
    p.add_argument("--ranks", type=int, default=None, help="data-parallel ranks (default: 1)")
    p.add_argument("--batches", type=int, default=4, help="micro-batches to show per rank")
    p.add_argument("--examples", type=int, default=3, help="decoded examples to show")
    p = command("train", "Train (run under torchrun / colossalai run, or use --nproc-per-node).")
    p.add_argument(
        "--nproc-per-node", type=int, default=None, help="launch this many local processes with torchrun"
    )
    # ---- precompute (reference log-probs cache; coati_kto.reference_cache)
    p = command(
        "precompute",
        "Score every example and KL pair with the reference model once; store with the prepared data "
        "(used by kto.reference=cached).",
    )
    p.add_argument(
        "--nproc-per-node", type=int, default=None, help="launch this many local processes with torchrun"
    )
    # ---- end precompute
    return parser


def _launch_local(args: argparse.Namespace) -> int:
    """Re-run the command (train, precompute) under torchrun with N local processes; returns its exit status."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.nproc_per_node}",
        "-m",
        "coati_kto",
        args.command,
        args.config,
        *args.overrides,
    ]
    return subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """argparse cannot take positional overrides after options (``--ranks 2 train.seed=1``): collect them."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    unknown = [item for item in extra if item.startswith("-") or "=" not in item]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        from coati_kto.config import load_config

        if args.command in ("train", "precompute") and args.nproc_per_node and "RANK" not in os.environ:
            load_config(args.config, args.overrides)  # fail here, once, rather than in N processes
            return _launch_local(args)
        config = load_config(args.config, args.overrides)
        if args.command == "prepare":
            from coati_kto.data.prepare import prepare

            prepare(config)
        elif args.command == "inspect":
            from coati_kto.data.inspect import inspect_batches

            inspect_batches(
                config, num_ranks=args.ranks, num_batches=args.batches, num_examples=args.examples
            )
        elif args.command == "precompute":
            from coati_kto.reference_cache import precompute

            precompute(config)
        else:
            from coati_kto.train import train

            train(config)
    except UserError as err:
        rank = os.environ.get("RANK")
        prefix = f"[rank {rank}] " if rank not in (None, "0") else ""
        print(f"{prefix}error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
