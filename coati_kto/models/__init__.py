"""The model side: loading causal LMs (``hf``), completion log-probs without a [B, S, V] logits tensor
(``logprobs``: the chunked LM head's math; ``lm_head``: the head found through any wrapper), the
shared-prompt pass for an example and its KL pair and padding-free rows (``packing``), and LoRA adapters
(``lora``).

No process-group logic here beyond a barrier around a shared write. May import: parallel, data, config,
families, errors.
"""
