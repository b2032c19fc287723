"""coati_kto.import_compiles: the import-time torch.compile calls of bitsandbytes and ColossalAI wait for a first call.

A launched process that imports the booster no longer loads inductor (1.2 CPU-seconds of each, docs/testing.md);
a deferred function still compiles, with the arguments its module gave, the first time it is called; every other
torch.compile is torch's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import torch

from coati_kto.import_compiles import DEFERRED_MODULES, deferred_compile

PROBE = """
import json, sys, torch
real = torch.compile
import coati_kto, colossalai.booster
from colossalai.quantization import fp8
from bitsandbytes.backends.default import ops
print(json.dumps({
    "inductor": "torch._inductor.compile_fx" in sys.modules,
    "torch_compile_restored": torch.compile is real,
    "deferred": sorted(m for m in %r if m in sys.modules),
}))
"""


def _probe() -> dict[str, Any]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("COATI_KTO_EAGER_IMPORT_COMPILES", None)
    done = subprocess.run(
        [sys.executable, "-c", PROBE % sorted(DEFERRED_MODULES)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_the_booster_loads_no_inductor() -> None:
    """One fresh process (5 CPU-s). With ``COATI_KTO_EAGER_IMPORT_COMPILES=1`` the same imports load inductor
    (torch 2.13, colossalai 0.5.0, bitsandbytes 0.50.2): checked by hand, not here, to keep the unit folder fast."""
    assert _probe() == {
        "inductor": False,
        "torch_compile_restored": True,
        "deferred": sorted(DEFERRED_MODULES),
    }


def test_a_deferred_function_compiles_once_at_its_first_call_with_its_arguments() -> None:
    calls: list[tuple[Any, dict[str, Any]]] = []

    def real(fn: Any = None, **kwargs: Any) -> Any:
        calls.append((fn, kwargs))
        return lambda *a, **k: ("compiled", fn(*a, **k))

    compile_later = deferred_compile(real)

    def add(a: int, b: int = 0) -> int:
        return a + b

    direct = compile_later(add, dynamic=False)  # torch.compile(fn, **kw)
    decorated = compile_later(mode="max-autotune-no-cudagraphs")(add)  # @torch.compile(**kw)
    assert calls == [] and direct.__name__ == "add"
    assert direct(1, b=2) == ("compiled", 3) and direct(2) == ("compiled", 2)
    assert decorated(5) == ("compiled", 5)
    assert calls == [(add, {"dynamic": False}), (add, {"mode": "max-autotune-no-cudagraphs"})]
    # A module is not a plain function: it goes to the real compile at once.
    module = torch.nn.Linear(2, 2)
    compile_later(module, fullgraph=True)
    assert calls[-1] == (module, {"fullgraph": True})
