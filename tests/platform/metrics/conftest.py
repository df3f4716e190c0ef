"""Helpers of the metrics tests: parse a Prometheus text scrape into {(sample name, labels): value}."""
from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families


def parse_scrape(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of a scrape, keyed by its name and label set (``_created`` samples left out)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def sample(values: dict, name: str, **labels) -> float | None:
    """The value of ``name`` summed over every series carrying ``labels`` (as PromQL's ``sum`` over the others,
    e.g. over versions); None when no series carries them."""
    want = set(labels.items())
    found = [v for (n, lbls), v in values.items() if n == name and want <= set(lbls)]
    return sum(found) if found else None


def label_values(values: dict, label: str, prefix: str = "loraplex_") -> set[str]:
    return {dict(lbls)[label] for (name, lbls) in values if name.startswith(prefix) and label in dict(lbls)}


@pytest.fixture
def scrape():
    return parse_scrape
