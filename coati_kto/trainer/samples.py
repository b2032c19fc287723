"""Samples during evaluation (``eval.samples``): a fixed, seeded set of eval prompts decoded greedily by the
policy, and at step 0 also by the reference, each with the policy's implied reward, to TensorBoard and W&B.

Every rank picks the same N rows of the eval set, each with a prompt of its own (the first rows of a
permutation seeded by ``eval.sample_seed`` whose prompts were not picked yet). Data-parallel rank d decodes
rows d, d + D, ..., padded to ceil(N / D) rows by repeating one of them, so that every rank runs the same
passes (DDP's forward and the tensor-parallel layers hold collectives); its tensor-parallel peers decode the
same rows in lockstep (``coati_kto.models.generate``). Each rank scores its completions with the trainer's own
passes (fp32 log-probs of the policy and the reference), and global rank 0 gathers the rows and writes them.
Image rows (issue 49): generation and scoring take the prompts' images (``coati_kto.trainer.sample_images``), and
each sample's first image, down-scaled, goes to TensorBoard beside the table and into W&B's table.
The implied reward of a completion y is beta * (log pi(y|x) - log pi_ref(y|x)), the reward the loss pushes up
for desirable completions (``coati_kto.trainer.loss.implied_reward``). It is exactly 0 at step 0 where policy
and reference are the same weights (no ``model.reference_path``).
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from coati_kto.data.collator import padded_view
from coati_kto.models.generate import eos_ids, greedy_generate
from coati_kto.parallel.distributed import ParallelLayout, gather_objects
from coati_kto.trainer.loss import implied_reward, log_ratio
from coati_kto.trainer.sample_images import SampleImages, scoring_keywords

COLUMNS = ("sample", "label", "reward", "prompt", "completion")


@dataclass(frozen=True)
class Sample:
    """One decoded prompt: its place in the seeded set, the eval row it came from and the row's label."""

    sample: int
    row: int
    label: bool
    prompt: str
    completion: str
    reward: float | None  # None without a reference model (kto.reference cached)
    prompt_ids: tuple[int, ...] = ()
    completion_ids: tuple[int, ...] = ()
    image: np.ndarray | None = field(
        default=None, compare=False
    )  # the prompt's first image, CHW uint8: the logs'


class EvalSamples:
    """The seeded prompts of this rank and their writer. Every rank builds one (same arguments) and calls
    :meth:`write` at every evaluation."""

    def __init__(
        self,
        rows: Any,
        count: int,
        max_new_tokens: int,
        seed: int,
        tokenizer: Any,
        layout: ParallelLayout,
        device: torch.device,
        images: SampleImages | None = None,
        pad_token_id: int | None = None,
    ) -> None:
        """``pad_token_id``: the id the run's batches pad with (its collator's: a pad token past the model's
        embeddings is passed over, ``coati_kto.data.vocabulary.pad_id``); None: the tokenizer's pad, else EOS."""
        if tokenizer is None:
            raise ValueError("eval samples need the tokenizer (KTOTrainer's tokenizer argument)")
        chosen = _distinct_prompts(rows, np.random.default_rng(seed).permutation(len(rows)), count)
        self.asked = count
        # (place in the set, row); None marks this rank's padding rows, decoded and dropped
        mine: list[tuple[int | None, int]] = list(enumerate(chosen))[layout.dp_rank :: layout.dp_size]
        per_rank = math.ceil(len(chosen) / layout.dp_size)
        mine += [(None, mine[-1][1] if mine else chosen[0])] * (per_rank - len(mine))
        self.places = [place for place, _ in mine]
        self.rows = [rows[row] for _, row in mine]
        self.prompts = [[int(t) for t in r["input_ids"][: int(r["completion_start"])]] for r in self.rows]
        self.row_ids = [row for _, row in mine]
        # Image rows: the prompts' pixels once (the prompts are fixed), for generation and scoring.
        self.images = images.prompt_images(self.rows) if images is not None else None
        self.logged = [images.logged(r) if images is not None else None for r in self.rows]
        self.tokenizer, self.layout, self.device = tokenizer, layout, device
        self.pad_token_id = pad_token_id
        self.max_new_tokens = max_new_tokens
        self.writer: Any = None  # MetricWriter: TensorBoard text and W&B tables (main rank)
        self.progress: Any = None  # ProgressBar: the timing line (main rank); print without one
        self.last: dict[str, list[Sample]] = {}  # the last evaluation's samples by model (main rank)

    @classmethod
    def for_run(cls, trainer: Any, eval_loader: Any) -> EvalSamples | None:
        """``trainer.options.samples`` of the eval loader's rows, written through the trainer's writer and
        progress bar (so built after them, in ``fit``); None when off or without an eval set."""
        loader = getattr(eval_loader, "loader", eval_loader)
        rows = getattr(loader, "dataset", None)
        options = trainer.options
        if not options.samples or rows is None or len(rows) == 0:
            return None
        samples = cls(
            rows,
            options.samples,
            options.sample_max_new_tokens,
            options.sample_seed,
            trainer.tokenizer,
            trainer.layout,
            trainer.device,
            SampleImages.of(getattr(loader, "collate_fn", None)),
            getattr(getattr(loader, "collate_fn", None), "pad_token_id", None),
        )
        samples.writer, samples.progress = trainer._writer, trainer._progress
        return samples

    def decode(self, model: Any, policy: Any, reference: Any, passes: Any) -> list[Sample]:
        """``model``'s greedy completions of this rank's prompts with the policy's implied rewards; every rank
        calls with the same models. Gathered: the whole set in order on global rank 0, [] elsewhere."""
        eos = eos_ids(policy, self.tokenizer)
        pad = self.pad_token_id
        if pad is None:
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos[0]
        synced = self.layout.world_size > 1
        completions = greedy_generate(
            model, self.prompts, self.max_new_tokens, pad, eos, self.device, synced, self.images
        )
        rewards: list[float | None] = [None] * len(completions)
        if reference is not None:
            whole = [p + c for p, c in zip(self.prompts, completions, strict=True)]
            view = padded_view(whole, [len(p) for p in self.prompts], pad).map(lambda t: t.to(self.device))
            with torch.no_grad():
                ratio = log_ratio(
                    passes.completion_logps(policy, view, scoring_keywords(policy, self.images, view)),
                    passes.completion_logps(reference, view, scoring_keywords(reference, self.images, view)),
                )
            rewards = implied_reward(ratio, passes.options.beta).tolist()
        local = [
            Sample(
                place, row, bool(r["label"]), self._text(p), self._text(c), reward, tuple(p), tuple(c), image
            )
            for place, row, r, p, c, reward, image in zip(
                self.places,
                self.row_ids,
                self.rows,
                self.prompts,
                completions,
                rewards,
                self.logged,
                strict=True,
            )
            if place is not None
        ]
        gathered = gather_objects(local)  # every rank's, on every rank: small (N rows of text)
        if not self.layout.is_main:
            return []
        found = {s.sample: s for rank in gathered for s in rank}  # tensor-parallel peers hold the same rows
        return [found[k] for k in sorted(found)]

    def _text(self, ids: list[int]) -> str:
        """The tokens as the model read or wrote them (chat-template markers and EOS included)."""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def write(self, policy: Any, reference: Any, passes: Any, step: int) -> dict[str, float]:
        """Decode with the policy (and at step 0 the reference) in eval mode, write the tables, leave the
        policy in train mode (where the trainer holds it outside evaluation). Every rank calls.

        Returns ``{"eval/samples_seconds": s}``: the wall time of decoding, scoring and gathering on this rank.
        """
        started = time.perf_counter()
        policy.eval()
        try:
            decoded = {"policy": self.decode(policy, policy, reference, passes)}
            if step == 0 and reference is not None:
                decoded["reference"] = self.decode(reference, policy, reference, passes)
        finally:
            policy.train()
        seconds = time.perf_counter() - started
        if self.layout.is_main:
            self.last = decoded
            for who, samples in decoded.items():
                rows = [[_cell(getattr(s, c)) for c in COLUMNS] for s in samples]
                images = [s.image for s in samples] if any(s.image is not None for s in samples) else None
                if self.writer is not None:
                    self.writer.text(f"eval/samples/{who}", samples_markdown(samples), step)
                    for s in samples if images is not None else ():
                        self.writer.image(f"eval/samples/{who}/image/{s.sample}", s.image, step)
                    self.writer.table(f"eval/samples/{who}", list(COLUMNS), rows, step, images)
            line = f"step {step}: {len(decoded['policy'])} eval samples ({' and '.join(decoded)}) in {seconds:.2f} s"
            if len(decoded["policy"]) < self.asked:  # the eval split holds fewer distinct prompts than asked
                line += f" (eval.samples {self.asked}: the eval split has {len(decoded['policy'])} distinct prompts)"
            (self.progress.write if self.progress is not None else print)(line)
        return {"eval/samples_seconds": seconds}


def _distinct_prompts(rows: Any, order: np.ndarray, count: int) -> list[int]:
    """The first ``count`` rows in ``order`` whose prompt no earlier pick has: a desirable and an undesirable record
    of one prompt decode to the same greedy text, so two samples on it would show one completion twice. A prompt
    is its tokens and its images (one question asked of many images is many prompts). Fewer when the rows hold
    fewer distinct prompts (the printed count says how many)."""
    seen: set[tuple] = set()
    chosen: list[int] = []
    for index in order.tolist():
        if len(chosen) == count:
            break
        row = rows[index]
        # the images' digests (coati_kto.data.image_table): equal images, equal digests
        images = tuple(bytes(ref) for ref in row.get("images") or ())
        prompt = (tuple(int(t) for t in row["input_ids"][: int(row["completion_start"])]), images)
        if prompt not in seen:
            seen.add(prompt)
            chosen.append(index)
    return chosen


def _cell(value: Any) -> Any:
    if isinstance(value, bool):
        return "desirable" if value else "undesirable"
    return "" if value is None else value


# The line boundaries of str.splitlines other than "\n" (a decoded "\r" or "\u2028" ended the table's row):
# written as numeric entities, which the markdown renders as the character and unescape reads back.
_BREAKS = "\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


def _escape(text: str) -> str:
    """A table cell's markdown: every character that could end or format the cell escaped, reversibly."""
    out = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    out = out.replace("\\", "\\\\").replace("|", "\\|").replace("`", "\\`").replace("*", "\\*")
    out = "".join(f"&#x{ord(c):x};" if c in _BREAKS else c for c in out)
    return out.replace("_", "\\_").replace("\n", "<br>")


def unescape(cell: str) -> str:
    """The text :func:`_escape` wrote (``coati_kto.testing.tensorboard.read_samples`` reads the tables)."""
    out, k = [], 0
    while k < len(cell):
        if cell.startswith("<br>", k):
            out.append("\n")
            k += 4
        elif cell[k] == "\\" and k + 1 < len(cell):
            out.append(cell[k + 1])
            k += 2
        else:
            out.append(cell[k])
            k += 1
    text = re.sub(r"&#x([0-9a-f]+);", lambda m: chr(int(m.group(1), 16)), "".join(out))
    return text.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")


def samples_markdown(samples: list[Sample]) -> str:
    """The samples as one markdown table (TensorBoard's TEXT tab renders it): one row per sample."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for s in samples:
        reward = "n/a" if s.reward is None else f"{s.reward:.6g}"
        cells = [str(s.sample), _cell(s.label), reward, _escape(s.prompt), _escape(s.completion)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
