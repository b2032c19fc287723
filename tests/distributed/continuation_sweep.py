"""Which model families' KL pass may continue from the examples' KV cache: every causal-LM type transformers
builds tiny (coati_kto.testing.tiny_types), fp32, its default attention kernel, one batch of random rows. A
type is admitted (``coati_kto.families.continuation.CONTINUATION_FAMILIES``) only when the continued KL log-probs equal a
separate pass over [x_i, y_j] within ``TOLERANCE`` nats per sequence on every row.

The trainer cannot see a wrong continuation: policy and reference would share it, so step-1 KL stays exactly 0
while z0 is wrong. Hence an allow-list proven here rather than a structural guess.

    python tests/distributed/continuation_sweep.py                 # every type: the verdicts and the list
    python tests/distributed/continuation_sweep.py --types llama   # some

tests/distributed/test_kl_continuation.py re-checks a representative subset in the normal suite and every
admitted type under the ``sweep`` marker (``make test-all``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/helpers when run as a script
from helpers import CORPUS  # noqa: E402
from test_packing import _rows  # noqa: E402

TOLERANCE = 1e-4  # fp32 nats per sequence (~20 tokens): summation order only is ~1e-6


def continuation_verdict(model: Any, vocab: int) -> tuple[str, float | None]:
    """("exact" | "differs" | "separate: why" | "fails: error", max |continued - separate| per sequence)."""
    from coati_kto.data.collator import KTOCollator
    from coati_kto.models.continuation import continuation_refusal, continued_logps
    from coati_kto.models.lm_head import LMHead, model_sequence_logps

    why = continuation_refusal(model, check_family=False)
    if why is not None:
        return f"separate: {why}", None
    batch = KTOCollator(0)(_rows(0, 6, vocab=vocab))  # every KL pair shares its prompt
    head = LMHead.find(model)
    try:
        with torch.no_grad():
            _, continued = continued_logps(model, batch.example, batch.kl_continuation, head)
            kl = batch.kl
            separate = model_sequence_logps(model, kl.input_ids, kl.attention_mask, kl.loss_mask, head)
    except Exception as exc:  # recorded, one line
        return f"fails: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}", None
    diff = float((continued - separate).abs().max())
    return ("exact" if diff <= TOLERANCE else "differs"), diff


def check_type(model_type: str, tokenizer: Any) -> tuple[str, float | None]:
    from coati_kto.families import auto_model_class
    from coati_kto.testing.tiny_types import tiny_config

    try:
        config = tiny_config(model_type, tokenizer)
        torch.manual_seed(0)
        model = auto_model_class(config).from_config(config).eval()
    except Exception as exc:
        return f"not built tiny: {type(exc).__name__}", None
    return continuation_verdict(model, len(tokenizer))


def main(argv: list[str] | None = None) -> int:
    from coati_kto.testing.tiny import build_tokenizer
    from coati_kto.testing.tiny_types import causal_lm_types

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="*", help="model types (default: every causal-LM type)")
    args = parser.parse_args(argv)
    tokenizer = build_tokenizer(CORPUS, vocab_size=300)
    exact = []
    for model_type in args.types or causal_lm_types():
        verdict, diff = check_type(model_type, tokenizer)
        print(f"{model_type:28s} {verdict}" + (f" ({diff:.2g})" if diff is not None else ""), flush=True)
        exact += [model_type] if verdict == "exact" else []
    print("exact:", sorted(exact))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
