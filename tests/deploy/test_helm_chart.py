"""The Helm chart in deploy/helm/loraplex, rendered and linted by real Helm (Go SDK v4 through helm-python-sdk)
for the default, production and dev values, every manifest validated against the Kubernetes JSON schemas
(kubernetes-validate, strict: unknown fields fail), and the deployment's invariants asserted."""
from __future__ import annotations

import glob
import json
import os
import re

import helm_python as helm
import kubernetes_validate
import pytest

from tests.deploy.conftest import CHART, KUBE_VERSION, REPO, VALUES_FILES, load_values, pod_templates, render

VALUE_SETS = list(VALUES_FILES)
# A key or env var name that names secret material ("SECRET_KEY", "adminKey", "password", "apiToken", ...).
SECRET_NAME = re.compile(r"(^|[_\-.])(key|secret|password|passwd|token|credentials?)([_\-.]|$)|"
                         r"(?<=[a-z])(Key|Secret|Password|Token|Credentials?)$|database[_-]?url|redis[_-]?url",
                         re.IGNORECASE)
# Keys whose literal value names a Secret, a key inside one or a label, never secret material.
NOT_SECRET_KEYS = {"existingSecret", "secretName", "secretKeyRef", "key", "topologyKey"}


def _camel_split(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name)


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(_camel_split(name)))


def secret_literals_in_values(values, path="") -> list[str]:
    """Paths of values whose key names secret material and whose value is a non-empty literal."""
    found = []
    if isinstance(values, dict):
        # env-style entries: {name: X_PASSWORD, value: literal}
        if is_secret_name(str(values.get("name", ""))) and values.get("value") not in (None, ""):
            found.append(f"{path} ({values['name']})")
        for key, value in values.items():
            sub = f"{path}.{key}" if path else str(key)
            if isinstance(value, (dict, list)):
                found += secret_literals_in_values(value, sub)
            elif key not in NOT_SECRET_KEYS and is_secret_name(str(key)) and value not in (None, "", False):
                found.append(sub)
    elif isinstance(values, list):
        for i, item in enumerate(values):
            found += secret_literals_in_values(item, f"{path}[{i}]")
    return found


def secret_literals_in_manifests(manifests: list[dict]) -> list[str]:
    """Literal secret material outside Secret objects: env vars with secret names and a plain `value`, and
    ConfigMap entries with secret names."""
    found = []
    for m in manifests:
        where = f"{m['kind']}/{m['metadata']['name']}"
        if m["kind"] == "Secret":
            continue
        if m["kind"] == "ConfigMap":
            found += [f"{where}:{k}" for k in m.get("data", {}) if is_secret_name(k.rsplit(".", 1)[0])]
            continue
        spec = m.get("spec", {}).get("template", {}).get("spec")
        if not spec:
            continue
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            for env in c.get("env", []):
                if "value" in env and is_secret_name(env["name"]):
                    found.append(f"{where}:{c['name']}:{env['name']}")
            for arg in c.get("args", []) + c.get("command", []):
                if re.search(r"://[^/\s:@]+:[^@\s$]+@", str(arg)):  # credentials inside a URL
                    found.append(f"{where}:{c['name']}: URL with credentials in arguments")
    return found


@pytest.mark.parametrize("name", VALUE_SETS)
def test_helm_lint_reports_no_warning_or_error(name):
    report = helm.lint(str(CHART), load_values(name), strict=True, kube_version=f"v{KUBE_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 1 = info ("icon is recommended")
    assert report["total_charts_linted"] == 1
    assert not problems and not report["errors"], f"helm lint ({name}): {problems} {report['errors']}"


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_manifest_validates_against_kubernetes_schemas(rendered, name):
    crds = {("monitoring.coreos.com/v1", "ServiceMonitor")}  # not in the Kubernetes schemas: checked below
    kinds = set()
    for m in rendered[name].manifests:
        kinds.add(m["kind"])
        if (m["apiVersion"], m["kind"]) in crds:
            spec = m["spec"]
            assert spec["selector"]["matchLabels"] and spec["endpoints"], m
            assert [e["port"] for e in spec["endpoints"]][:1] == ["metrics"]        # the platform: its metrics port
            assert all(e["port"] in ("metrics", "http") and e["path"] == "/metrics" for e in spec["endpoints"])
            continue
        try:
            kubernetes_validate.validate(m, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{name}: {m['kind']}/{m['metadata']['name']}: {'.'.join(map(str, e.caught.path))}: "
                        f"{e.caught.message}")
    assert {"Deployment", "StatefulSet", "Service", "Job", "ConfigMap", "PodDisruptionBudget"} <= kinds


def test_schema_validation_rejects_bad_values_with_the_key_named():
    with pytest.raises(helm.HelmValuesError, match="replicas"):
        render({"engine": {"replicas": 0}})
    with pytest.raises(helm.HelmValuesError, match="ADMIN_KEY"):
        render({"platform": {"settings": {"ADMIN_KEY": "hunter2"}}})
    with pytest.raises(helm.HelmValuesError, match="runAsNonRoot"):
        render({"podSecurityContext": {"runAsNonRoot": False, "runAsUser": 10001}})
    with pytest.raises(helm.HelmValuesError, match="engineReplicas"):
        render({"engineReplicas": 3})  # a typo: unknown keys are refused, not ignored


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_container_has_resources_and_long_running_ones_have_probes(rendered, name):
    templates = pod_templates(rendered[name])
    assert templates
    for workload, spec in templates:
        for c in spec["containers"] + spec.get("initContainers", []):
            where = f"{name}: {workload['kind']}/{workload['metadata']['name']}:{c['name']}"
            res = c.get("resources", {})
            assert res.get("requests", {}).get("cpu") and res.get("requests", {}).get("memory"), where
            assert res.get("limits", {}).get("memory"), where
            if workload["kind"] not in ("Job", "CronJob"):  # a run-to-completion job has nothing to probe
                assert "readinessProbe" in c and "livenessProbe" in c, where


@pytest.mark.parametrize("name", VALUE_SETS)
def test_all_pods_run_as_non_root_without_capabilities(rendered, name):
    for workload, spec in pod_templates(rendered[name]):
        where = f"{name}: {workload['kind']}/{workload['metadata']['name']}"
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] > 0, where
        assert pod["seccompProfile"]["type"] == "RuntimeDefault", where
        assert spec["automountServiceAccountToken"] is False, where
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and not sc.get("privileged"), where
            assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add"), where
            assert sc["readOnlyRootFilesystem"] is True, where
            mounts = {v["mountPath"] for v in c.get("volumeMounts", [])}
            assert "/tmp" in mounts or "/data" in mounts, f"{where}: no writable emptyDir"


@pytest.mark.parametrize("name", VALUE_SETS)
def test_engine_pods_request_gpus_on_gpu_nodes_and_turn_ready_after_load(rendered, name):
    r = rendered[name]
    values = r.values.get("engine", {})
    sts = r.one("StatefulSet", "-engine")
    spec = sts["spec"]["template"]["spec"]
    (engine,) = spec["containers"]
    gpus = values.get("gpusPerReplica", 1)
    assert engine["resources"]["requests"]["nvidia.com/gpu"] == gpus
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == gpus
    assert spec["nodeSelector"]["nvidia.com/gpu.present"] == "true"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert engine["readinessProbe"]["httpGet"]["path"] == "/health"  # 503 until the model is loaded
    assert "httpGet" not in engine["livenessProbe"]  # a long load must not restart the pod
    assert engine["args"][:2] == ["engine", "serve"] and "--enable-lora" in engine["args"]
    pdb = r.one("PodDisruptionBudget", "-engine")
    assert pdb["spec"]["selector"]["matchLabels"] == sts["spec"]["selector"]["matchLabels"]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_platform_gets_one_url_per_engine_replica_on_the_headless_service(rendered, name):
    r = rendered[name]
    sts = r.one("StatefulSet", "-engine")
    headless = r.one("Service", "-engine")
    assert headless["spec"]["clusterIP"] == "None" and headless["metadata"]["name"] == sts["spec"]["serviceName"]
    assert headless["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]
    env = {e["name"]: e for e in r.one("Deployment", "-platform")["spec"]["template"]["spec"]["containers"][0]["env"]}
    urls = json.loads(env["LORAPLEX_ENGINE_URLS"]["value"])
    sts_name, port = sts["metadata"]["name"], headless["spec"]["ports"][0]["port"]
    assert urls == [f"http://{sts_name}-{i}.{sts_name}.loraplex.svc.cluster.local:{port}"
                    for i in range(sts["spec"]["replicas"])]
    assert len(urls) == r.values.get("engine", {}).get("replicas", 1)


@pytest.mark.parametrize("name", VALUE_SETS)
def test_no_secret_material_outside_secret_objects(rendered, name):
    r = rendered[name]
    assert secret_literals_in_manifests(r.manifests) == []
    assert secret_literals_in_values(r.values) == []
    secrets = r.of_kind("Secret")
    if name == "dev":  # only the dev services' generated credentials
        assert [s["metadata"]["name"] for s in secrets] == ["lpx-loraplex-dev"]
    else:
        assert secrets == [], "the chart must not create Secrets for external services"
    env = {e["name"]: e for e in r.one("Deployment", "-platform")["spec"]["template"]["spec"]["containers"][0]["env"]}
    for var in ("LORAPLEX_DATABASE_URL", "LORAPLEX_ADMIN_KEY", "LORAPLEX_SECRET_KEY", "LORAPLEX_REDIS_URL"):
        assert "secretKeyRef" in env[var]["valueFrom"], var


def test_chart_values_file_has_no_secret_literals():
    import yaml

    assert secret_literals_in_values(yaml.safe_load((CHART / "values.yaml").read_text())) == []


def test_secret_scanners_flag_planted_literals():
    planted = render({"platform": {"extraEnv": [{"name": "LORAPLEX_ADMIN_KEY", "value": "hunter2"}]}})
    assert any(f.endswith(":platform:LORAPLEX_ADMIN_KEY") for f in secret_literals_in_manifests(planted.manifests))
    assert secret_literals_in_values({"s3": {"secretAccessKey": "abc"}, "db": {"password": "p"},
                                      "x": {"existingSecret": "ok"}}) == ["s3.secretAccessKey", "db.password"]
    assert secret_literals_in_values({"extraEnv": [{"name": "API_TOKEN", "value": "t"}]}) == \
        ["extraEnv[0] (API_TOKEN)"]


def test_tuning_configmap_is_the_repository_tuning_configs_mounted_at_the_tuning_dir(rendered):
    r = rendered["default"]
    repo_files = {f"{p.parent.name}__{p.name}": json.loads(p.read_text())
                  for p in (REPO / "tuning_configs").glob("*/*.json")}
    assert repo_files, "tuning_configs/ has no <device>/<op>.json files"
    cm = r.one("ConfigMap", "-tuning-configs")
    assert {k: json.loads(v) for k, v in cm["data"].items()} == repo_files, "deploy/helm/loraplex/files/tuning_configs is stale: run `make chart-configs`"
    spec = r.one("StatefulSet", "-engine")["spec"]["template"]["spec"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "tuning-configs"]
    assert {i["path"] for i in volume["configMap"]["items"]} == {k.replace("__", "/") for k in repo_files}
    engine = spec["containers"][0]
    (mount,) = [m for m in engine["volumeMounts"] if m["name"] == "tuning-configs"]
    env = {e["name"]: e.get("value") for e in engine["env"]}
    assert env["LORAPLEX_TUNING_DIR"] == mount["mountPath"]


@pytest.mark.parametrize("name,hook", [("default", "pre-install,pre-upgrade"), ("production", "pre-install,pre-upgrade"),
                                       ("dev", "post-install,pre-upgrade")])
def test_migrations_run_as_a_helm_hook_job(rendered, name, hook):
    job = rendered[name].one("Job", "-migrate")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == hook
    (c,) = job["spec"]["template"]["spec"]["containers"]
    command = " ".join(c.get("command", []) + c.get("args", []))
    assert "db upgrade" in command
    env = {e["name"] for e in c["env"]}
    assert {"LORAPLEX_DATABASE_URL", "LORAPLEX_ENVIRONMENT"} <= env


def test_production_values_scale_out_and_monitor(rendered):
    r = rendered["production"]
    hpa = r.one("HorizontalPodAutoscaler", "-platform")
    assert hpa["spec"]["minReplicas"] >= 2 and hpa["spec"]["scaleTargetRef"]["name"].endswith("-platform")
    assert "replicas" not in r.one("Deployment", "-platform")["spec"]  # the HPA owns the count
    assert r.one("PodDisruptionBudget", "-platform") and r.one("PodDisruptionBudget", "-engine")
    assert r.one("StatefulSet", "-engine")["spec"]["replicas"] >= 2
    sm = r.one("ServiceMonitor", "lpx-loraplex")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    dashboards = r.one("ConfigMap", "-dashboards")
    assert dashboards["metadata"]["labels"]["grafana_dashboard"] == "1"
    for text in dashboards["data"].values():
        assert json.loads(text)["panels"]
    assert not r.of_kind("Secret") and not [m for m in r.manifests if "dev-" in m["metadata"]["name"]]


def test_default_values_leave_optional_objects_out(rendered):
    kinds = {m["kind"] for m in rendered["default"].manifests}
    assert not kinds & {"HorizontalPodAutoscaler", "ServiceMonitor", "Secret"}
    assert [p["metadata"]["name"] for p in rendered["default"].of_kind("PodDisruptionBudget")] == ["lpx-loraplex-engine"]


def _container_env(workload: dict) -> dict[str, str]:
    """A container's env as the kubelet would give it, secretKeyRef values replaced by placeholders."""
    placeholders = {"database-url": "postgresql+psycopg://u:p@db:5432/loraplex", "redis-url": "redis://:p@redis:6379/0"}
    env = {}
    for e in workload["spec"]["template"]["spec"]["containers"][0]["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            key = e["valueFrom"]["secretKeyRef"]["key"]
            env[e["name"]] = placeholders.get(key, f"placeholder-{key}")
    return env


@pytest.mark.parametrize("name", VALUE_SETS)
def test_platform_settings_parse_the_rendered_environment(rendered, name, monkeypatch):
    """Every LORAPLEX_* variable the chart sets is a field of the platform's Settings (pydantic ignores unknown
    names, so a typo would pass silently), and the values parse: engine URLs, aliases, quotas, secrets."""
    from loraplex.platform.core.config import Settings

    r = rendered[name]
    for workload in (r.one("Deployment", "-platform"), r.one("Job", "-migrate")):
        env = _container_env(workload)
        for var in env:
            if var.startswith("LORAPLEX_"):
                assert var.removeprefix("LORAPLEX_").lower() in Settings.model_fields, f"{name}: unknown setting {var}"
        for var in [v for v in os.environ if v.startswith("LORAPLEX_")]:
            monkeypatch.delenv(var)
        for var, value in env.items():
            monkeypatch.setenv(var, value)
        settings = Settings(_env_file=None)
        assert settings.environment == "production" and settings.blob_backend == "s3"
        assert settings.admin_key.get_secret_value() == "placeholder-admin-key"
        if workload["kind"] == "Deployment":
            assert len(settings.engine_urls) == r.values.get("engine", {}).get("replicas", 1)
            assert settings.redis_url and settings.spool_dir == "/spool"
            assert settings.max_rank == r.values.get("engine", {}).get("lora", {}).get("maxRank", 16)
    engine_env = _container_env(r.one("StatefulSet", "-engine"))
    s3_vars = {v for v in engine_env if v.startswith("LORAPLEX_S3_") or v == "LORAPLEX_BLOB_BACKEND"}
    assert s3_vars and all(v.removeprefix("LORAPLEX_").lower() in Settings.model_fields for v in s3_vars)


def test_switches_off_render_valid_manifests_without_the_switched_parts():
    r = render({"engine": {"enabled": False}, "redis": {"enabled": False}, "s3": {"existingSecret": ""},
                "fullnameOverride": "lp"})
    assert not r.of_kind("StatefulSet")
    assert sorted(s["metadata"]["name"] for s in r.of_kind("Service")) == ["lp-platform", "lp-platform-metrics"]
    env = {e["name"]: e for e in r.one("Deployment", "lp-platform")["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["LORAPLEX_ENGINE_MODE"]["value"] == "none" and "LORAPLEX_ENGINE_URLS" not in env
    assert "LORAPLEX_REDIS_URL" not in env and "LORAPLEX_S3_ACCESS_KEY_ID" not in env  # ambient S3 credentials
    for m in r.manifests:
        kubernetes_validate.validate(m, KUBE_VERSION, strict=True)


def test_servicemonitor_scrapes_engines_unless_turned_off(rendered):
    def components(r):
        (expr,) = r.one("ServiceMonitor", "lpx-loraplex")["spec"]["selector"]["matchExpressions"]
        return expr["values"]

    assert components(rendered["production"]) == ["platform-metrics", "engine"]   # engines serve /metrics too
    off = render({"metrics": {"serviceMonitor": {"enabled": True, "scrapeEngines": False}}})
    assert components(off) == ["platform-metrics"]
    assert [e["port"] for e in off.one("ServiceMonitor", "lpx-loraplex")["spec"]["endpoints"]] == ["metrics"]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_tenant_labelled_metrics_are_served_only_on_the_internal_metrics_service(rendered, name):
    """The API Service (what an Ingress or LoadBalancer exposes) carries no metrics port; the scrape without auth
    is a ClusterIP Service of its own on the pods' metrics port."""
    r = rendered[name]
    api, metrics = r.one("Service", "-platform"), r.one("Service", "-platform-metrics")
    assert [p["name"] for p in api["spec"]["ports"]] == ["http"]
    assert metrics["spec"]["type"] == "ClusterIP" and [p["targetPort"] for p in metrics["spec"]["ports"]] == ["metrics"]
    assert metrics["spec"]["selector"] == api["spec"]["selector"]
    (c,) = r.one("Deployment", "-platform")["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["LORAPLEX_METRICS_PORT"] == str(ports["metrics"]) == str(metrics["spec"]["ports"][0]["port"])
    assert ports["metrics"] != ports["http"] and env["LORAPLEX_METRICS_HOST"] == "0.0.0.0"


def test_janitor_runs_in_the_pods_and_optionally_as_a_cronjob(rendered):
    assert not rendered["default"].of_kind("CronJob")
    env = {e["name"]: e.get("value") for e in
           rendered["default"].one("Deployment", "-platform")["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["LORAPLEX_JANITOR_INTERVAL_S"] == "300" and env["LORAPLEX_UPLOAD_STALE_AFTER_S"] == "900"
    r = render({"janitor": {"intervalSeconds": 0, "staleAfterSeconds": 600,
                            "cronJob": {"enabled": True, "schedule": "*/5 * * * *"}}})
    cron = r.one("CronJob", "-janitor")
    assert cron["spec"]["schedule"] == "*/5 * * * *" and cron["spec"]["concurrencyPolicy"] == "Forbid"
    (c,) = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    assert c["args"] == ["db", "janitor"]
    cron_env = {e["name"]: e.get("value") for e in c["env"]}
    assert cron_env["LORAPLEX_UPLOAD_STALE_AFTER_S"] == "600" and "LORAPLEX_DATABASE_URL" in cron_env
    pod_env = {e["name"]: e.get("value") for e in
               r.one("Deployment", "-platform")["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert pod_env["LORAPLEX_JANITOR_INTERVAL_S"] == "0"
    kubernetes_validate.validate(cron, KUBE_VERSION, strict=True)
    with pytest.raises(helm.HelmValuesError, match="schedule"):
        render({"janitor": {"intervalSeconds": 0, "staleAfterSeconds": 1, "cronJob": {"enabled": True,
                                                                                       "schedule": "often"}}})


def test_grafana_dashboard_configmap_is_the_repository_dashboard(rendered):
    """The chart ships deploy/grafana/*.json (copied into files/dashboards by `make chart-configs`)."""
    repo = {os.path.basename(p): json.load(open(p)) for p in glob.glob(os.path.join(REPO, "deploy", "grafana", "*.json"))}
    cm = rendered["production"].one("ConfigMap", "-dashboards")
    assert {k: json.loads(v) for k, v in cm["data"].items()} == repo, \
        "deploy/helm/loraplex/files/dashboards is stale: run `make chart-configs`"
