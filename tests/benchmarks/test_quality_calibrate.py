"""How the quality benchmark picks a variant of each kind of task (benchmarks/quality/calibrate.py), and that each
variant's reference is what its prompt asks for."""

from __future__ import annotations

import json
import random
import re

from benchmarks.quality.calibrate import Candidate, candidates, pick
from benchmarks.quality.tasks import CANDIDATES, CATEGORIES, TASKS


def cell(task: str, default: float, trials: list[float]) -> dict:
    return {"task": task, "scores": {"default": default},
            "winners": {"oracle": {"all": {f"t{i}": v for i, v in enumerate(trials)}}}}


def test_the_widest_spread_among_eligible_candidates_wins() -> None:
    found = candidates([
        cell("reading-3", 0.99, [0.2, 1.0]),      # spread 0.8, but its best trial solves it: not eligible
        cell("reading-5", 0.60, [0.3, 0.8]),      # eligible, spread 0.5
        cell("topics-2v1", 0.02, [0.0, 0.9]),     # the default is at the floor: not eligible
        cell("topics-3v2", 0.50, [0.45, 0.55]),   # eligible, spread 0.1
        cell("add", 0.01, [0.0, 0.2]),            # no arithmetic candidate is eligible: the widest spread anyway
        cell("multistep-small", 0.0, [0.0, 0.1]),
        cell("reading-5", 0.0, [0.0, 0.0]),       # a second seed of a task: the first is the one read
    ])
    assert found["reading-5"] == Candidate("reading-5", 0.60, 0.3, 0.8)
    picked = pick(found)
    assert picked["short-answer QA"] == ("reading-5", True)
    assert picked["classification (6 labels)"] == ("topics-3v2", True)
    assert picked["arithmetic"] == ("add", False)
    assert picked["instruction following (chrF)"] == ("rewrite", True)  # its kind's only task
    assert "structured output (JSON)" not in picked  # not calibrated


def test_every_candidate_is_a_task_of_its_kind() -> None:
    for kind, names in CANDIDATES.items():
        assert all(TASKS[name].kind == kind for name in names)


def test_each_variant_asks_what_its_reference_answers() -> None:
    rng = random.Random(7)
    for _ in range(200):
        prompt, answer = TASKS["reading-5"].make(rng)
        passage, question = prompt.split("\nQuestion: ")
        assert passage.count(". ") == 4 and answer in passage
        name = re.search(r"(does|is) (\w+)('s)? ", question).group(2)  # type: ignore[union-attr]
        [about] = [s for s in passage.split(". ") if s.startswith(name + " ")]
        assert answer in about
        prompt, label = TASKS["topics-3v2"].make(rng)
        words = prompt.split("\n")[1].split()
        counts = {c: sum(w in members for w in words) for c, members in CATEGORIES.items()}
        assert counts[label] == 3 and sorted(counts.values())[-2] == 2
        prompt, reference = TASKS["extract-pick3"].make(rng)
        job = re.search(r"Extract the (\w+)'s", prompt).group(1)  # type: ignore[union-attr]
        wanted = json.loads(reference)
        assert wanted["job"] == job
        assert f"{wanted['name']} ({wanted['age']}) is a {job} from {wanted['city']}." in prompt
        prompt, total = TASKS["multistep-small"].make(rng)
        a, b, c = map(int, re.findall(r"\d+", prompt))
        assert a + b - c == int(total) >= 0 and max(a, b) <= 9
