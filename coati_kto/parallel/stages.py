"""Pipeline stages as ColossalAI 0.5.0 runs them: which layers a stage holds and how many micro-batches' activations
it keeps alive at once.

- :func:`distribute_layers` is ``PipelineStageManager.distribute_layers``: ``layers // (stages x chunks)`` each,
  the remainder one more on the middle ones (from ``(stages x chunks) // 2 - remainder // 2``). Chunk ``c`` of
  stage ``s`` is virtual stage ``s + c x stages`` (``get_stage_index``).
- The first stage also holds the embedding, the last the final norm and the LM head; tied embeddings are held on
  both (``get_shared_params``).
- :func:`in_flight`: the forwards whose activations a stage keeps for their backwards at the most. 1F1B runs
  ``stages - stage - 1`` warm-up forwards, then one more before its first backward (``one_f_one_b.py``);
  interleaved runs ``2 (stages - stage - 1) + (chunks - 1) stages`` warm-up chunk forwards, then one more
  (``interleaved_pp.py``); both capped by the forwards of the step.
"""

from __future__ import annotations

from coati_kto.families.splits import distribute_layers

PP_STYLES = ("1f1b", "interleaved")
__all__ = ["PP_STYLES", "distribute_layers", "in_flight", "stage_chunks"]


def stage_chunks(layers: int, stages: int, chunks: int, stage: int) -> list[int]:
    """The layers of each of ``stage``'s chunks."""
    split = distribute_layers(layers, stages, chunks)
    return [split[stage + c * stages] for c in range(chunks)]


def in_flight(stage: int, stages: int, microbatches: int, style: str = "1f1b", chunks: int = 1) -> int:
    """Chunk forwards whose activations ``stage`` holds at once at the most (module docstring)."""
    if style == "interleaved":
        warmup = 2 * (stages - stage - 1) + (chunks - 1) * stages
        return min(warmup + 1, microbatches * chunks)
    return min(stages - stage, microbatches)


def least_microbatches(stages: int, style: str, wanted: int) -> int:
    """The fewest micro-batches a training step may run from ``wanted``: at least ``stages`` (1F1B's
    ``num_microbatches >= num_stages``), a multiple of ``stages`` when interleaved."""
    if stages == 1:
        return wanted
    if style == "interleaved":
        return -(-wanted // stages) * stages
    return max(wanted, stages)


def bubble(stages: int, microbatches: int, chunks: int = 1) -> float:
    """The share of a step each stage idles: ``(stages - 1) / (microbatches x chunks + stages - 1)``."""
    return (stages - 1) / (microbatches * chunks + stages - 1)
