"""The reference model's log-probs, computed once and stored with the prepared data (``kto.reference: cached``):
the cache and its key (``cache.py``), the scoring over the ranks (``scoring.py``), the reference weights by content
(``weights.py``) and what all of them read of the config (``settings.py``)."""
