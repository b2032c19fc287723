"""Whether torch DDP must look for parameters a backward does not reach (``find_unused_parameters``).

DDP built without it fails the second step of a model whose trainable parameters do not all get a gradient
("Expected to have finished reduction in the prior iteration"): cross-attention without an encoder, sparse
indexers whose output is indices (19 transformers types: bart, whisper, git, deepseek_v32, ...), an MoE expert
kept as its own module that no token of a rank's micro-batch reached. Turned on for every model, it costs each
gradient forward a walk of the autograd graph and each backward a used-flag per parameter, read on the host and
all-reduced, and torch warns on every rank of every run of a model that uses all its parameters. So the policy
is probed once, before boosting: one forward of one token (an MoE routes it to its top-k experts only, so
separate expert modules show up unreached), whose logits' autograd graph is walked, no backward. Where the probe
cannot run (a kernel the model's device lacks, inputs the family needs), the answer is "look for them".

Not seen by the probe: a parameter that one token reaches but a later step does not (flow control on the step or
on the data beyond routing). Layer-drop style training is the known kind; transformers' causal LMs default it off.
"""

from __future__ import annotations

import torch
from torch import nn


def unreached_parameters(model: nn.Module) -> list[str] | None:
    """Names of ``model``'s trainable parameters that one forward of one token (``input_ids`` [1, 1], in the
    model's current mode, on its device) leaves out of its logits' autograd graph; None when the forward fails.

    Every rank calls it with the same model (the answer is the same everywhere: it depends on the model only).
    No gradient is computed; the random state is left as it was (dropout and LoRA dropout draw in train mode);
    compiled regions run eager.
    """
    trainable = {id(p): name for name, p in model.named_parameters() if p.requires_grad}
    if not trainable:
        return []
    device = next(model.parameters()).device
    ids = torch.ones(1, 1, dtype=torch.long, device=device)
    rng_devices = [device] if device.type == "cuda" else []
    try:
        with (
            torch.random.fork_rng(devices=rng_devices),
            torch.enable_grad(),
            torch.compiler.set_stance("force_eager"),
        ):
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    except Exception:  # any failure: the caller assumes unused parameters (the safe answer)
        return None
    reached: set[int] = set()
    seen: set[object] = set()
    stack = [logits.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf, i.e. a parameter
        if variable is not None:
            reached.add(id(variable))
        stack.extend(child for child, _ in node.next_functions)
    return [name for key, name in trainable.items() if key not in reached]
