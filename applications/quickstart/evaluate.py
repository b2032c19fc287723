"""The task metric: greedy-decoding accuracy on held-out prompts and the log-prob margin of right over wrong.

For each prompt of ``eval_prompts.jsonl`` (phrasings unseen in SFT and KTO):
* the model decodes greedily; the answer is scored ``correct`` (the successor), ``wrong`` (the predecessor:
  the bad behaviour of the feedback data) or ``other``;
* margin = log p(correct | prompt) - log p(wrong | prompt), summed over the completion tokens coati-kto
  trains on (the answer, ``<|im_end|>`` and the template's newline).
Accuracy 50% with margin ~0 is a coin flip between the two behaviours; KTO should move both up.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from sft import encode
from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class Scores:
    accuracy: float  # fraction answered correctly
    wrong_rate: float  # fraction answered with the predecessor
    margin: float  # mean log p(correct) - log p(wrong), nats
    other_rate: float  # fraction answered with anything else
    n: int


def grade(answer: str, correct: str, wrong: str) -> str:
    """'correct' | 'wrong' | 'other' for a decoded answer (surrounding whitespace and a final period ignored)."""
    answer = answer.strip().rstrip(".").strip().lower()
    return "correct" if answer == correct.lower() else "wrong" if answer == wrong.lower() else "other"


def score_rows(rows: list[dict], answers: list[str], margins: list[float]) -> Scores:
    """Aggregate per-prompt results (pure: tested on hand-made outputs)."""
    grades = [grade(a, r["correct"], r["wrong"]) for a, r in zip(answers, rows, strict=True)]
    return Scores(
        accuracy=grades.count("correct") / len(rows),
        wrong_rate=grades.count("wrong") / len(rows),
        margin=sum(margins) / len(margins),
        other_rate=grades.count("other") / len(rows),
        n=len(rows),
    )


@torch.no_grad()
def completion_logprob(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompt: str, answer: str
) -> float:
    """log p(answer | chat-formatted prompt), summed over the completion tokens (see ``sft.encode``)."""
    ids, n_prompt = encode(
        tokenizer, [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    )
    logits = model(torch.tensor([ids])).logits[0, n_prompt - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(ids[n_prompt:])[:, None]).sum().item()


@torch.no_grad()
def greedy_answer(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompt: str, max_new: int = 4
) -> str:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=False
    )
    out = model.generate(
        torch.tensor([ids]),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)


def evaluate(model_dir: str | Path, rows: list[dict]) -> Scores:
    """Load an HF model dir (tokenizer alongside) and score it on ``rows`` of eval_prompts.jsonl."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    answers = [greedy_answer(model, tokenizer, r["prompt"]) for r in rows]
    margins = [
        completion_logprob(model, tokenizer, r["prompt"], r["correct"])
        - completion_logprob(model, tokenizer, r["prompt"], r["wrong"])
        for r in rows
    ]
    return score_rows(rows, answers, margins)


def table(results: dict[str, Scores]) -> str:
    """A Markdown table, one row per model."""
    lines = [
        "| model | accuracy (successor) | predecessor | other | margin log p(good) - log p(bad) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, s in results.items():
        lines.append(
            f"| {name} | {s.accuracy:.1%} | {s.wrong_rate:.1%} | {s.other_rate:.1%} | {s.margin:+.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", required=True, help="eval_prompts.jsonl from make_data.py")
    parser.add_argument("models", nargs="+", help="NAME=MODEL_DIR, e.g. before=outputs/quickstart/sft")
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny matrices: a second thread costs more in synchronisation than it saves
    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines()]
    results = {spec.split("=", 1)[0]: evaluate(spec.split("=", 1)[1], rows) for spec in args.models}
    print(f"{len(rows)} held-out prompts\n" + table(results))


if __name__ == "__main__":
    main()
