"""``coati_kto.train.train(config)``: the training recipe's public entry, kept at this path for the tests,
benchmarks and applications that call it. The recipe itself: ``coati_kto.recipe.train``."""

from coati_kto.recipe.train import train

__all__ = ["train"]
