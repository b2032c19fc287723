"""FlexAttention with gradients on CPU, for tests: torch's own reference implementation of the operator.

torch 2.13 refuses a FlexAttention backward on CPU at its front door (``_validate_device``), and inductor's CPU
flex kernel, which transformers compiles, has no backward. The operator itself has a math forward and backward
(``sdpa_dense`` / ``sdpa_dense_backward`` in ``torch._higher_order_ops.flex_attention``: scores materialized,
the reference torch checks its fused kernels against). Inside :func:`flex_reference` a flex pass runs that
implementation, uncompiled, with gradients, so the training path with flex_attention (block masks per pass,
the folded policy pass, z0 between forward and backward) runs end to end on CPU. What it does not prove is the
fused kernel's backward: that runs on a GPU (tests/distributed/test_gpu_path.py). Training outside tests keeps
refusing flex_attention on CPU (coati_kto.runtime.preflight).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def flex_reference() -> Iterator[None]:
    """Within: flex_attention calls run torch's reference operator (forward and backward) on any device, no
    compile (transformers' compiled wrapper included). Call in the process that runs the model (each rank)."""
    import torch.nn.attention.flex_attention as flex
    from transformers.integrations import flex_attention as hf_flex

    saved = (
        flex._validate_device,
        flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG,
        hf_flex.WrappedFlexAttention.__call__,
    )
    flex._validate_device = lambda *_: None
    flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = (
        True  # the operator as it is (no fullgraph compile around it)
    )
    hf_flex.WrappedFlexAttention.__call__ = lambda self: flex.flex_attention
    try:
        yield
    finally:
        flex._validate_device, flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = saved[:2]
        hf_flex.WrappedFlexAttention.__call__ = saved[2]
