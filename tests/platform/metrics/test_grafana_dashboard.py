"""deploy/grafana/loraplex-dashboard.json: valid, every query names a metric the platform exports, no overlaps."""
from __future__ import annotations

import json
import os
import re

from loraplex.platform.metrics import PlatformMetrics
from tests.platform.metrics.conftest import parse_scrape
from tests.utils.grafana import check_grid

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
DASHBOARD = os.path.join(REPO, "deploy", "grafana", "loraplex-dashboard.json")


def exported_names() -> set[str]:
    m = PlatformMetrics()
    m.observe_request("t", "a", 500, 0.1, 0.01, 1.0, 1, 1)
    m.observe_quota_rejection("t", "tokens")
    m.observe_upload("ready")
    m.apply_engine_stats("e0", {"adapters": {"loading": ["x"]}})
    m.apply_engine_stats("e0", {"adapters": {"loading": []}})
    return {name for name, _ in parse_scrape(m.exposition().decode())}


def test_every_query_uses_an_exported_metric_and_panels_do_not_overlap():
    with open(DASHBOARD) as f:
        dash = json.load(f)
    assert dash["uid"] == "loraplex-overview" and dash["title"] == "loraplex"
    names = exported_names()
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    used = {n for e in exprs for n in re.findall(r"\bloraplex_[a-z0-9_]+", e)}
    assert used and used <= names, sorted(used - names)
    for family in ("loraplex_requests_total", "loraplex_time_to_first_token_seconds_bucket",
                   "loraplex_engine_adapters_resident", "loraplex_uploads_total", "loraplex_quota_rejections_total",
                   "loraplex_engine_adapter_load_seconds_bucket", "loraplex_engine_gpu_slot_hit_rate"):
        assert family in used, family
    check_grid(dash)
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "tenant", "replica"} <= variables
