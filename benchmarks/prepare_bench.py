"""Time ``prepare`` on synthetic tool-use conversations (ChatML messages, 746:254 labels), tiny BPE tokenizer.

Run from the repository root: ``python benchmarks/prepare_bench.py [--records 100000] [--num-proc 2]``.
Prints examples/s and tokens/s of a cold build (read + validate + tokenize + KL pairs + write), then the
time of a warm call that reuses the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from coati_kto.config.schema import Config  # noqa: E402
from coati_kto.data.prepared import prepare  # noqa: E402
from coati_kto.data.settings import PrepareSettings  # noqa: E402
from coati_kto.data.weights import WeightSettings  # noqa: E402
from coati_kto.testing.tiny import build_tokenizer  # noqa: E402

TOOLS = [
    "search(query: str) -> list of results with title and url",
    "read_note(path: str) -> the note's markdown",
    "write_note(path: str, content: str) -> ok",
    "list_folder(path: str) -> file names",
]
SYSTEM = (
    "You are an assistant for a personal knowledge base. You can call these tools:\n"
    + "\n".join(f"- {t}" for t in TOOLS)
    + '\nCall a tool by answering with a JSON object {"tool": name, "arguments": {...}}. '
    "Never invent file paths; list folders first. Answer in the user's language."
)
TOPICS = ["weather", "meeting notes", "travel plans", "reading list", "recipes", "project ideas", "budget"]


def _cpu_seconds() -> float:
    """User + system CPU time of this process and its finished children (the map workers)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def make_records(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    labels = rng.random(n) < 746 / 1000
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        user = f"Find my {topic} from week {i % 52} and summarise the {int(rng.integers(2, 9))} key points."
        if labels[i]:
            reply = json.dumps({"tool": "search", "arguments": {"query": f"{topic} week {i % 52}"}})
        else:
            reply = f"I think your {topic} are probably in notes/{topic}.md, here is a summary I made up."
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": user},
            {"role": "assistant", "content": reply},
        ]
        out.append({"messages": messages, "label": bool(labels[i])})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="200 records, 1 process (seconds)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.records, args.num_proc = 200, 1

    root = Path(tempfile.mkdtemp(prefix="prepare_bench_"))
    try:
        records = make_records(args.records)
        corpus = [SYSTEM, *TOPICS] + [r["messages"][2]["content"] for r in records[:200]]
        build_tokenizer(corpus, vocab_size=1024).save_pretrained(root / "tok")
        data = root / "train.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in records))
        config = Config.model_validate(
            {
                "model": {"path": str(root / "tok")},
                "data": {
                    "train_files": [str(data)],
                    "prepared_dir": str(root / "prepared"),
                    "max_length": 1024,
                    "max_prompt_length": 768,
                    "num_proc": args.num_proc,
                },
                "output": {"dir": str(root / "out")},
            }
        )
        settings = PrepareSettings(config.data, config.model, config.train.seed)
        weights = WeightSettings(config.kto, config.train.micro_batch_size)
        start, cpu_start = time.perf_counter(), _cpu_seconds()
        out = prepare(settings, weights)
        cold, cpu = time.perf_counter() - start, _cpu_seconds() - cpu_start
        tokens = int(np.asarray(out.train["length"]).sum() + np.asarray(out.train["kl_length"]).sum())
        start = time.perf_counter()
        prepare(settings, weights)
        warm = time.perf_counter() - start
        print(
            f"\nprepare_bench: {args.records} records, num_proc {args.num_proc}, {os.cpu_count()} CPUs: "
            f"cold {cold:.1f} s = {args.records / cold:,.0f} examples/s ({tokens / cold:,.0f} tokens/s incl. KL), "
            f"warm (cache reused) {warm:.2f} s; {data.stat().st_size / 2**20:.0f} MiB of JSONL\n"
            f"  CPU time, all processes: {cpu:.0f} s = {args.records / cpu:,.0f} examples per CPU-second "
            f"(what an idle machine gets per core; load average now {os.getloadavg()[0]:.1f})"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
