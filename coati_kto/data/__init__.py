"""Data pipeline: formats, tokenization, KL pairs, tables, the prepared-data store, sampler, collator.

No process groups here: which rank builds the store is :mod:`coati_kto.prepared`'s business.
"""
