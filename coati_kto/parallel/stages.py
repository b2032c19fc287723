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
- :func:`held_hidden`: the hidden states [mb, S, H] a stage holds besides its layers' activations. The schedules
  keep each chunk forward's received input and its output (``input_objs`` / ``output_objs``) until its backward,
  and receive the gradient of the output for that backward; interleaved also receives the next forward's input
  before it. ColossalAI keeps no buffer of its own: every receive is a new tensor (``p2p._create_recv_buffer``).
"""

from __future__ import annotations

import functools
from collections import Counter

from coati_kto.families.splits import distribute_layers

PP_STYLES = ("1f1b", "interleaved")
__all__ = ["PP_STYLES", "distribute_layers", "held_hidden", "in_flight", "kept_hidden", "stage_chunks"]


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


def kept_hidden(stage: int, stages: int, chunk: int, chunks: int, input_kept: bool) -> int:
    """The hidden states one chunk forward of ``stage`` keeps until its backward: its output, unless it is the
    last virtual stage's (the loss); its received input, unless it is the first virtual stage's (token ids) or
    its first layer keeps that very tensor anyway (``input_kept``, counted in its activations)."""
    output = 0 if (stage, chunk) == (stages - 1, chunks - 1) else 1
    received = 0 if (stage, chunk) == (0, 0) or input_kept else 1
    return output + received


@functools.lru_cache(maxsize=4096)
def held_hidden(
    stage: int, stages: int, microbatches: int, style: str = "1f1b", chunks: int = 1, input_kept: bool = True
) -> int:
    """The most hidden states [mb, S, H] ``stage`` holds at once besides its layers' activations (module
    docstring), at a backward: those its chunk forwards in flight keep (:func:`kept_hidden`), the gradient it
    received for the backward (none for the loss) and, interleaved, the next forward's input. Replays the
    schedule's order: forward k runs chunk ``(k mod stages x chunks) // stages``, backward k the reverse."""
    total = microbatches * chunks
    warmup = min(in_flight(stage, stages, microbatches, style, chunks) - 1, total)
    if style != "interleaved":
        chunks = 1

    def chunk(k: int, forward: bool = True) -> int:
        c = (k % (stages * chunks)) // stages
        return c if forward else chunks - 1 - c

    held = Counter(chunk(k) for k in range(warmup))
    most = 0
    for k in range(total):  # backward k, after forward warmup + k where there is one
        ahead = warmup + k
        held.update([chunk(ahead)] if ahead < total else [])
        # interleaved receives the next forward's input before this backward; 1F1B after it
        early = style == "interleaved" and ahead + 1 < total and (stage, chunk(ahead + 1)) != (0, 0)
        back = chunk(k, forward=False)
        gradient = (stage, back) != (stages - 1, chunks - 1)
        kept = sum(n * kept_hidden(stage, stages, c, chunks, input_kept) for c, n in held.items())
        most = max(most, kept + int(early) + int(gradient))
        held[back] -= 1
    return most


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
