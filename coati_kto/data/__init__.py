"""Data pipeline: formats, tokenization, KL pairs, tables, the prepared-data store, sampler, collator, and the
commands' views of it (``prepared``: rank 0 builds, every rank loads; ``weights``: the KTO weights and the
imbalance report; ``inspect``: what each rank's micro-batches will hold).

Tensors and arrow tables only; the one collective is in ``prepared`` (rank 0 builds while the others wait).
May import: parallel.distributed, config, errors.
"""
