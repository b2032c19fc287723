"""Data pipeline: formats, tokenization, KL pairs, prepare, sampler, collator."""
