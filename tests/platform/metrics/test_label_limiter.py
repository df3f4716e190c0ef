"""LabelLimiter: the heaviest keys keep their name, everything else is "_other", the cap is never exceeded."""
from __future__ import annotations

import random

import pytest

from loraplex.platform.metrics import OTHER, LabelLimiter, MetricsConfig, PlatformMetrics
from tests.platform.metrics.conftest import label_values, parse_scrape, sample


def test_first_keys_fill_the_room_then_overflow_is_other():
    lim = LabelLimiter(3)
    assert [lim.label(k) for k in ("a", "b", "c", "d")] == ["a", "b", OTHER, OTHER]
    assert lim.named == {"a", "b"} and lim.peek("c") == OTHER and lim.peek("a") == "a"


def test_a_heavy_newcomer_takes_the_weakest_name_and_the_caller_hears_of_it():
    evicted = []
    lim = LabelLimiter(3, on_evict=evicted.append)
    lim.label("a", weight=10)
    lim.label("b", weight=1)
    assert lim.label("c", weight=1) == OTHER            # 1 is not > 2 x 1
    assert lim.label("c", weight=2) == "c"              # guaranteed 3 > 2 x 1: "b" (weakest) loses its name
    assert evicted == ["b"] and lim.named == {"a", "c"}
    assert lim.label("b", weight=1) == OTHER             # 2 is not > 2 x 3: hysteresis, no flapping back


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="max_values must be an integer >= 2"):
        LabelLimiter(1)
    with pytest.raises(ValueError, match="promote_ratio must be >= 1.0"):
        LabelLimiter(5, promote_ratio=0.5)
    with pytest.raises(ValueError, match="max_adapter_labels must be >= 2"):
        MetricsConfig(max_adapter_labels=1)


def test_ten_thousand_adapters_stay_within_the_cap_and_heavy_ones_keep_their_name():
    cap = 50
    m = PlatformMetrics(MetricsConfig(max_adapter_labels=cap))
    rng = random.Random(7)
    heavy = [f"heavy-{i}" for i in range(10)]
    events = [f"cold-{i}" for i in range(10_000)] + heavy * 300   # 13,000 requests over 10,010 adapters
    rng.shuffle(events)
    for i, adapter in enumerate(events):
        m.observe_request("acme", adapter, 200, 0.01, 0.001, 0.05, prompt_tokens=3, completion_tokens=2)
        if i % 1000 == 0:  # the cap holds at every moment, not just at the end
            assert len(label_values(parse_scrape(m.exposition().decode()), "adapter")) <= cap
    values = parse_scrape(m.exposition().decode())
    adapters = label_values(values, "adapter")
    assert len(adapters) <= cap and OTHER in adapters
    assert set(heavy) <= adapters                       # every heavy hitter has its own series
    # nothing is lost: named + _other requests add up to everything sent since each name's (re)admission;
    # counters of names that lost their label were dropped, so the sum is at most the total
    total = sum(v for (name, _), v in values.items() if name == "loraplex_requests_total")
    assert 0 < total <= len(events)
    for a in heavy:  # a heavy adapter, admitted early and never evicted, counts its own traffic exactly
        assert sample(values, "loraplex_requests_total", tenant="acme", adapter=a, status="200") >= 250
    assert m.adapters.evictions > 0
    assert sample(values, "loraplex_adapter_label_evictions_total") == m.adapters.evictions
