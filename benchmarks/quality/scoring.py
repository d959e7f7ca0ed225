"""The quality benchmark's held-out metrics, each a score in [0, 1] of one answer against its reference.

- ``exact``: equal after normalising (case, surrounding space and punctuation, runs of spaces).
- ``json_fields``: the share of the reference object's fields that the first JSON object in the answer has with the
  same value (numbers compared as numbers: ``"34"`` is 34); 0 when the answer holds no JSON object.
- ``chrf``: chrF (Popović, 2015; sacreBLEU's defaults): character n-grams of orders 1-6, spaces removed, precision
  and recall averaged over the orders, then F with beta = 2 (recall weighted twice). Written here: twenty lines,
  where sacreBLEU would be a dependency for one function.
"""

from __future__ import annotations

import json
import string
from collections import Counter
from typing import Any

CHRF_ORDER, CHRF_BETA = 6, 2.0


def normalise(text: str) -> str:
    return " ".join(text.strip().strip(string.punctuation + " ").lower().split())


def exact(answer: str, reference: str) -> float:
    return float(normalise(answer) == normalise(reference))


def first_json_object(text: str) -> dict[str, Any] | None:
    """The first ``{...}`` in ``text`` that parses as a JSON object, or None."""
    decoder = json.JSONDecoder()
    for start in (i for i, c in enumerate(text) if c == "{"):
        try:
            value, _ = decoder.raw_decode(text[start:])
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def _same(a: Any, b: Any) -> bool:
    if isinstance(b, int | float) and not isinstance(b, bool):
        try:
            return float(a) == float(b)
        except (TypeError, ValueError):
            return False
    return isinstance(a, str) and normalise(a) == normalise(str(b))


def json_fields(answer: str, reference: str) -> float:
    expected = json.loads(reference)
    got = first_json_object(answer)
    if got is None or not expected:
        return 0.0
    return sum(_same(got.get(key), value) for key, value in expected.items()) / len(expected)


def _ngrams(text: str, n: int) -> Counter[str]:
    return Counter(text[i:i + n] for i in range(len(text) - n + 1))


def chrf(answer: str, reference: str) -> float:
    hyp, ref = "".join(answer.split()), "".join(reference.split())
    precisions, recalls = [], []
    for n in range(1, CHRF_ORDER + 1):
        hyp_grams, ref_grams = _ngrams(hyp, n), _ngrams(ref, n)
        if not hyp_grams or not ref_grams:
            continue  # an order longer than either text: not counted (sacreBLEU's effective order)
        matched = sum((hyp_grams & ref_grams).values())
        precisions.append(matched / sum(hyp_grams.values()))
        recalls.append(matched / sum(ref_grams.values()))
    if not precisions:
        return float(hyp == ref)
    precision, recall = sum(precisions) / len(precisions), sum(recalls) / len(recalls)
    if precision == 0 and recall == 0:
        return 0.0
    beta2 = CHRF_BETA**2
    return (1 + beta2) * precision * recall / (beta2 * precision + recall)
