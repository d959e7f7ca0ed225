"""Prometheus text parsed for assertions, by prometheus_client's own parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Key = tuple[str, frozenset[tuple[str, str]]]


def samples(text: str) -> dict[Key, float]:
    """Every sample of the exposition: (sample name, its labels) -> value."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(parsed: dict[Key, float], name: str, **labels: str) -> float:
    """A sample's value; 0 for a sample that is absent (a counter of a label set not yet counted)."""
    return parsed.get((name, frozenset(labels.items())), 0.0)


def matching(parsed: dict[Key, float], name: str, **labels: str) -> dict[Key, float]:
    """The samples of ``name`` whose labels include ``labels`` (a histogram's buckets, every label set)."""
    wanted = set(labels.items())
    return {k: v for k, v in parsed.items() if k[0] == name and wanted <= k[1]}
