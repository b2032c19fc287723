"""The model side: loading causal LMs (``hf``), completion log-probs without a [B, S, V] logits tensor
(``logprobs``: the chunked LM head), the shared-prompt pass for an example and its KL pair (``packing``), and
LoRA adapters (``lora``).

No process-group logic here beyond a barrier around a shared write. May import: parallel, data, config,
families, errors.
"""
