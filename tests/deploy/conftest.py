"""Fixtures of the deployment checks: the chart rendered by real Helm (helm-python-sdk, Helm's Go SDK in a
shared library) for each values file, once per session.

    rendered["production"] -> Rendering(values, manifests=[{kind, metadata, ...}, ...], notes)
    engine_config_of(rendering, monkeypatch) -> the engine settings the real CLI builds from the rendered args
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import helm_python as helm
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "loraplex"
VALUES_FILES = {
    "default": None,                                              # the chart's values.yaml alone
    "production": REPO / "deploy" / "helm" / "values-production.yaml",
    "dev": REPO / "deploy" / "helm" / "values-dev.yaml",
}
RELEASE, NAMESPACE = "lpx", "loraplex"
KUBE_VERSION = "1.27.0"  # the chart's lowest kubeVersion: schemas of later versions only add fields


@dataclass
class Rendering:
    values: dict
    manifests: list[dict]
    notes: str

    def of_kind(self, kind: str) -> list[dict]:
        return [m for m in self.manifests if m["kind"] == kind]

    def one(self, kind: str, name_suffix: str) -> dict:
        found = [m for m in self.of_kind(kind) if m["metadata"]["name"].endswith(name_suffix)]
        assert len(found) == 1, f"expected one {kind} named *{name_suffix}, got {[m['metadata']['name'] for m in found]}"
        return found[0]


def load_values(name: str) -> dict:
    path = VALUES_FILES[name]
    return yaml.safe_load(path.read_text()) if path else {}


def render(values: dict) -> Rendering:
    """Renders the chart as `helm template lpx deploy/helm/loraplex -n loraplex -f ...` would."""
    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    manifests, notes = [], ""
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        manifests += [doc for doc in yaml.safe_load_all(text) if doc]
    return Rendering(values=values, manifests=manifests, notes=notes)


@pytest.fixture(scope="session")
def rendered() -> dict[str, Rendering]:
    return {name: render(load_values(name)) for name in VALUES_FILES}


def pod_templates(rendering: Rendering) -> list[tuple[dict, dict]]:
    """(workload, pod spec) of every Deployment, StatefulSet, Job and CronJob."""
    out = []
    for m in rendering.manifests:
        if m["kind"] in ("Deployment", "StatefulSet", "Job"):
            out.append((m, m["spec"]["template"]["spec"]))
        elif m["kind"] == "CronJob":
            out.append((m, m["spec"]["jobTemplate"]["spec"]["template"]["spec"]))
    return out


def engine_config_of(rendering, monkeypatch) -> dict:
    """The EngineConfig fields `loraplex engine serve` builds from the engine container's rendered args."""
    import loraplex.commands.engine as engine_cmd
    import loraplex.engine.server.serve as serve_mod
    from loraplex.cli import main

    seen: list[dict] = []
    monkeypatch.setattr(engine_cmd, "_check_settings", lambda model, kwargs: None)   # no model folder here
    monkeypatch.setattr(serve_mod, "real_service", lambda model, **kw: seen.append(kw))
    monkeypatch.setattr(serve_mod, "serve", lambda make, **kw: make())
    main(rendering.one("StatefulSet", "-engine")["spec"]["template"]["spec"]["containers"][0]["args"])
    [kw] = seen
    return kw
