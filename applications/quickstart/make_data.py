"""The quickstart task: "what comes after X?" in three sequences, with binary feedback.

X is a letter, a weekday or a month. The good answer depends on the prompt and is checkable by code (the
successor); the bad one is plausible and systematic: the predecessor, an off-by-one in the wrong direction.
Files written to ``out_dir``:

* ``sft.jsonl``: every (item, training phrasing) twice, answered with the successor and with the predecessor
  (50/50), so the fine-tuned base knows both neighbours of every item but is unsure which one is asked for.
* ``kto_train.jsonl``: ``{"messages": [user, assistant], "label": bool}``, exactly 3:1 desirable:undesirable;
  desirable = the successor, undesirable = the predecessor. (Holding items out of KTO does not work at this
  scale: the tiny model learns which answer tokens were desirable, and an unseen item's successor never was.)
* ``kto_eval.jsonl``: the same shape on held-out phrasings (TensorBoard's eval/ scalars).
* ``eval_prompts.jsonl``: ``{"prompt", "correct", "wrong"}``, every item on four held-out phrasings.

Everything is a pure function of ``seed``.
"""

from __future__ import annotations

import argparse
import random
import string
from pathlib import Path

from coati_kto.data.files import write_jsonl

# Letters stop short of z and a (no successor / predecessor); weekdays and months wrap around.
SEQUENCES = {
    "letter": (list(string.ascii_lowercase), False),
    "day": (["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"], True),
    "month": (
        ["January", "February", "March", "April", "May", "June", "July"]
        + ["August", "September", "October", "November", "December"],
        True,
    ),
}
# A phrasing = prefix + question. A quarter of the 30 combinations is held out for evaluation: every word of a
# held-out phrasing was seen in training, only the combination is new (a tiny model cannot learn synonyms it
# never saw). Questions end with the item so it sits at a fixed distance from the answer: a 2-layer model
# learns that attention pattern in a few hundred steps, while a varying distance takes it far longer.
PREFIXES = ("", "Quick question: ", "Hi! ", "Please help. ", "Hello. ", "One more: ")
QUESTIONS = (
    "Which {k} comes after {x}?",
    "What is the {k} after {x}?",
    "Name the {k} that comes after {x}.",
    "Tell me the {k} right after {x}.",
    "What {k} follows {x}?",
)
DESIRABLE_FRACTION = 0.75  # 3:1, the imbalance the seeds' users had (746:254)


def items() -> list[tuple[str, str]]:
    """Every (kind, item) that has both neighbours."""
    out = []
    for kind, (seq, cyclic) in SEQUENCES.items():
        out += [(kind, x) for x in (seq if cyclic else seq[1:-1])]
    return out


def answers(kind: str, item: str) -> tuple[str, str]:
    """(correct, wrong): the successor and the predecessor of ``item`` in its sequence."""
    seq, _ = SEQUENCES[kind]
    i = seq.index(item)
    return seq[(i + 1) % len(seq)], seq[i - 1]


def phrasings(rng: random.Random) -> tuple[list[str], list[str]]:
    """(training, held-out) templates with {k} (kind) and {x} (item) slots, 3/4 and 1/4 of them."""
    templates = [p + q for p in PREFIXES for q in QUESTIONS]
    rng.shuffle(templates)
    cut = len(templates) * 3 // 4
    return templates[:cut], templates[cut:]


def chat(prompt: str, completion: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]


def kto_records(pairs: list[tuple[str, str]], templates: list[str], n: int, rng: random.Random) -> list[dict]:
    """``n`` labelled records on random (item, template) prompts, exactly round(n * 3/4) desirable."""
    n_good = round(n * DESIRABLE_FRACTION)
    labels = [True] * n_good + [False] * (n - n_good)
    rng.shuffle(labels)
    records = []
    for label in labels:
        kind, item = rng.choice(pairs)
        correct, wrong = answers(kind, item)
        prompt = rng.choice(templates).format(k=kind, x=item)
        records.append({"messages": chat(prompt, correct if label else wrong), "label": label})
    return records


def make_data(
    seed: int = 0, n_train: int = 1000, n_eval: int = 200, prompts_per_item: int = 4
) -> dict[str, list]:
    """All four datasets (see the module docstring), keyed by file stem."""
    rng = random.Random(seed)
    train_t, heldout_t = phrasings(rng)
    every = items()
    sft = [
        {"messages": chat(t.format(k=k, x=x), a)} for k, x in every for t in train_t for a in answers(k, x)
    ]
    rng.shuffle(sft)
    eval_prompts = [
        {"prompt": t.format(k=k, x=x), "correct": answers(k, x)[0], "wrong": answers(k, x)[1]}
        for k, x in every
        for t in rng.sample(heldout_t, prompts_per_item)
    ]
    return {
        "sft": sft,
        "kto_train": kto_records(every, train_t, n_train, rng),
        "kto_eval": kto_records(every, heldout_t, n_eval, rng),
        "eval_prompts": eval_prompts,
    }


def corpus(datasets: dict[str, list[dict]]) -> list[str]:
    """Every text the tokenizer should know (what a pretrained tokenizer would have seen)."""
    texts = [m["content"] for rows in datasets.values() for r in rows for m in r.get("messages", [])]
    return (
        texts
        + [r["prompt"] for r in datasets["eval_prompts"]]
        + [x for seq, _ in SEQUENCES.values() for x in seq]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="outputs/quickstart/data")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for name, rows in make_data(args.seed).items():
        write_jsonl(rows, Path(args.out) / f"{name}.jsonl")
        print(f"wrote {len(rows):5d} rows to {Path(args.out) / name}.jsonl")


if __name__ == "__main__":
    main()
