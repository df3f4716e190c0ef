"""The chart's operator options, each rendered on and off by real Helm and validated: core objects against the
Kubernetes schemas (kubernetes-validate, strict), the two custom resources (Gateway API HTTPRoute, KEDA
ScaledObject) against strict schemas of their references (crd_schemas.py), plus ``helm lint`` with everything on.

    ServiceAccount (workload identity)   engine autoscaling (HPA on Pods metrics | KEDA)   platform HPA on requests/s
    PodDisruptionBudgets                 Ingress (nginx / ALB annotations)               HTTPRoute
    keep-alive of both servers           vLLM-compatible engine metric names
    engine batch / adapter caps and adapter memory (null: the engine derives them; the rendered args are parsed by
    the real `loraplex engine serve`)
"""
from __future__ import annotations

import json

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest

from tests.deploy.conftest import CHART, KUBE_VERSION, engine_config_of, pod_templates, render
from tests.deploy.crd_schemas import HTTPROUTE_V1, PROMETHEUS_TRIGGER_METADATA, SCALEDOBJECT_V1ALPHA1

CRDS = {("gateway.networking.k8s.io/v1", "HTTPRoute"): HTTPROUTE_V1,
        ("keda.sh/v1alpha1", "ScaledObject"): SCALEDOBJECT_V1ALPHA1}
IRSA = {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/loraplex"}
EVERYTHING = {
    "serviceAccount": {"annotations": {**IRSA, "iam.gke.io/gcp-service-account": "lpx@p.iam.gserviceaccount.com",
                                       "azure.workload.identity/client-id": "00000000-0000-0000-0000-000000000000"},
                       "azureWorkloadIdentity": True},
    "platform": {"autoscaling": {"enabled": True, "targetRequestsPerSecond": 25}, "pdb": {"enabled": True}},
    "engine": {"autoscaling": {"enabled": True, "mode": "hpa", "minReplicas": 2, "maxReplicas": 6},
               "metrics": {"vllmCompatibleNames": True},
               "speculative": {"method": "draft", "draftModel": "/models/Qwen3-0.6B",
                               "draftAdapters": {"t/bot/1": "/models/drafts/bot"}}},
    "ingress": {"enabled": True, "className": "nginx", "hosts": [{"host": "api.example.com"}],
                "tls": [{"secretName": "lpx-tls", "hosts": ["api.example.com"]}]},
    "httpRoute": {"enabled": True, "parentRefs": [{"name": "public", "namespace": "gateway-system",
                                                   "sectionName": "https"}], "hostnames": ["api.example.com"]},
}


def validate_all(rendering) -> set[str]:
    kinds = set()
    for m in rendering.manifests:
        kinds.add(m["kind"])
        schema = CRDS.get((m["apiVersion"], m["kind"]))
        if schema is not None:
            jsonschema.validate(m, schema)
        elif m["apiVersion"] != "monitoring.coreos.com/v1":
            kubernetes_validate.validate(m, KUBE_VERSION, strict=True)
    return kinds


def env_of(workload: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in workload["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_everything_on_renders_valid_and_lints():
    r = render(EVERYTHING)
    kinds = validate_all(r)
    assert {"ServiceAccount", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Ingress", "HTTPRoute"} <= kinds
    report = helm.lint(str(CHART), EVERYTHING, strict=True, kube_version=f"v{KUBE_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], (problems, report["errors"])
    keda = {**EVERYTHING, "engine": {"autoscaling": {"enabled": True, "mode": "keda"}}}
    assert "ScaledObject" in validate_all(render(keda))
    assert not helm.lint(str(CHART), keda, strict=True, kube_version=f"v{KUBE_VERSION}")["errors"]


# ----------------------------------------------------------------------------------------------- ServiceAccount


@pytest.mark.parametrize("values", [{}, {"devServices": {"enabled": True}}], ids=["default", "dev"])
def test_every_pod_runs_as_the_charts_service_account(values):
    r = render(values)
    (sa,) = r.of_kind("ServiceAccount")
    assert sa["metadata"]["name"] == "lpx-loraplex" and sa["automountServiceAccountToken"] is False
    templates = pod_templates(render({**values, "janitor": {"cronJob": {"enabled": True}}}))
    assert len(templates) >= 4
    for workload, spec in templates:
        assert spec["serviceAccountName"] == "lpx-loraplex", workload["metadata"]["name"]
        assert spec["automountServiceAccountToken"] is False


def test_workload_identity_annotations_and_azure_pod_label():
    r = render(EVERYTHING)
    (sa,) = r.of_kind("ServiceAccount")
    assert sa["metadata"]["annotations"] == EVERYTHING["serviceAccount"]["annotations"]
    for workload, _ in pod_templates(r):
        labels = (workload["spec"].get("jobTemplate", {}).get("spec", workload["spec"]))["template"]["metadata"]["labels"]
        assert labels["azure.workload.identity/use"] == "true", workload["metadata"]["name"]
    plain = render({"serviceAccount": {"annotations": IRSA}})
    for workload, _ in pod_templates(plain):
        assert "azure.workload.identity/use" not in workload["spec"]["template"]["metadata"]["labels"]


def test_production_values_give_the_pods_an_irsa_identity(rendered):
    r = rendered["production"]
    (sa,) = r.of_kind("ServiceAccount")
    assert sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].startswith("arn:aws:iam::")
    assert {spec["serviceAccountName"] for _, spec in pod_templates(r)} == {sa["metadata"]["name"]}
    env = env_of(r.one("Deployment", "-platform"))
    assert "LORAPLEX_S3_ACCESS_KEY_ID" not in env                     # ambient (IRSA) credentials


def test_an_existing_service_account_is_used_not_created():
    named = render({"serviceAccount": {"create": False, "name": "team-sa"}})
    assert not named.of_kind("ServiceAccount")
    assert {spec["serviceAccountName"] for _, spec in pod_templates(named)} == {"team-sa"}
    default = render({"serviceAccount": {"create": False}})
    assert {spec["serviceAccountName"] for _, spec in pod_templates(default)} == {"default"}
    assert render({"serviceAccount": {"name": "custom"}}).one("ServiceAccount", "custom")


# ------------------------------------------------------------------------------------------ engine autoscaling


def test_engine_autoscaling_is_off_by_default():
    r = render({})
    assert not r.of_kind("HorizontalPodAutoscaler") and not r.of_kind("ScaledObject")
    assert r.one("StatefulSet", "-engine")["spec"]["replicas"] == 1


def test_engine_hpa_on_queue_depth_and_kv_usage():
    r = render({"engine": {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6,
                                           "targetQueueLength": 3, "targetKvUsage": 0.75}}})
    validate_all(r)
    sts = r.one("StatefulSet", "-engine")
    assert "replicas" not in sts["spec"]                       # the HPA owns the count
    hpa = r.one("HorizontalPodAutoscaler", "-engine")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet",
                                             "name": sts["metadata"]["name"]}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    metrics = {m["pods"]["metric"]["name"]: m["pods"]["target"] for m in hpa["spec"]["metrics"]}
    assert metrics == {"loraplex_engine_server_queue_length": {"type": "AverageValue", "averageValue": "3"},
                       "loraplex_engine_server_kv_usage_ratio": {"type": "AverageValue", "averageValue": "750m"}}
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 600
    urls = json.loads(env_of(r.one("Deployment", "-platform"))["LORAPLEX_ENGINE_URLS"])
    name = sts["metadata"]["name"]
    assert urls == [f"http://{name}-{i}.{name}.loraplex.svc.cluster.local:8100" for i in range(6)]
    queue_only = render({"engine": {"autoscaling": {"enabled": True, "targetKvUsage": None}}})
    (metric,) = queue_only.one("HorizontalPodAutoscaler", "-engine")["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == "loraplex_engine_server_queue_length"


def test_engine_keda_scaledobject_with_prometheus_triggers():
    r = render({"engine": {"autoscaling": {"enabled": True, "mode": "keda", "maxReplicas": 8,
                                           "keda": {"serverAddress": "http://prom.monitoring:9090"}}}})
    validate_all(r)
    assert not r.of_kind("HorizontalPodAutoscaler")
    so = r.one("ScaledObject", "-engine")
    sts = r.one("StatefulSet", "-engine")
    assert so["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"
    assert so["spec"]["scaleTargetRef"]["name"] == sts["metadata"]["name"] and "replicas" not in sts["spec"]
    assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (1, 8)
    triggers = {t["name"]: t for t in so["spec"]["triggers"]}
    assert set(triggers) == {"queue-length", "kv-usage"}
    for t in triggers.values():
        assert t["type"] == "prometheus" and t["metricType"] == "AverageValue"
        jsonschema.validate(t["metadata"], PROMETHEUS_TRIGGER_METADATA)
        assert t["metadata"]["serverAddress"] == "http://prom.monitoring:9090"
        assert 'namespace="loraplex"' in t["metadata"]["query"]
        assert f'pod=~"{sts["metadata"]["name"]}-[0-9]+"' in t["metadata"]["query"]
    assert "loraplex_engine_server_queue_length" in triggers["queue-length"]["metadata"]["query"]
    assert triggers["kv-usage"]["metadata"]["threshold"] == "0.8"
    behavior = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 600


def test_platform_hpa_keeps_cpu_and_can_add_request_rate():
    cpu_only = render({"platform": {"autoscaling": {"enabled": True}}}).one("HorizontalPodAutoscaler", "-platform")
    assert [m["type"] for m in cpu_only["spec"]["metrics"]] == ["Resource"]
    hpa = render({"platform": {"autoscaling": {"enabled": True, "targetRequestsPerSecond": 25}}}).one(
        "HorizontalPodAutoscaler", "-platform")
    cpu, rps = hpa["spec"]["metrics"]
    assert cpu["resource"]["name"] == "cpu"
    assert rps["pods"] == {"metric": {"name": "loraplex_requests_per_second"},
                           "target": {"type": "AverageValue", "averageValue": "25"}}


def test_autoscaling_bounds_are_checked():
    with pytest.raises(helm.HelmRenderError, match="minReplicas must be <="):
        render({"engine": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}})
    with pytest.raises(helm.HelmValuesError, match="mode"):
        render({"engine": {"autoscaling": {"enabled": True, "mode": "vpa"}}})
    with pytest.raises(helm.HelmValuesError, match="targetKvUsage"):
        render({"engine": {"autoscaling": {"enabled": True, "targetKvUsage": 1.5}}})


# ------------------------------------------------------------------------------------------------------- PDBs


def test_pdbs_select_their_workloads_and_take_min_available_or_max_unavailable():
    r = render({"platform": {"pdb": {"enabled": True, "minAvailable": "50%"}}})
    validate_all(r)
    platform, engine = r.one("PodDisruptionBudget", "-platform"), r.one("PodDisruptionBudget", "-engine")
    assert platform["spec"]["minAvailable"] == "50%" and "maxUnavailable" not in platform["spec"]
    assert engine["spec"]["maxUnavailable"] == 1 and "minAvailable" not in engine["spec"]
    for pdb, workload in ((platform, r.one("Deployment", "-platform")), (engine, r.one("StatefulSet", "-engine"))):
        assert pdb["spec"]["selector"]["matchLabels"] == workload["spec"]["selector"]["matchLabels"]
        assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"   # a loading pod never blocks a drain
    off = render({"engine": {"pdb": {"enabled": False}}})
    assert not off.of_kind("PodDisruptionBudget")


# -------------------------------------------------------------------------------------------- Ingress, HTTPRoute


def test_ingress_off_by_default_and_nginx_annotations_suit_streaming():
    assert not render({}).of_kind("Ingress") and not render({}).of_kind("HTTPRoute")
    r = render({"ingress": EVERYTHING["ingress"]})
    validate_all(r)
    ing = r.one("Ingress", "-platform")
    a = ing["metadata"]["annotations"]
    assert a["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"             # SSE tokens flow at once
    assert a["nginx.ingress.kubernetes.io/proxy-request-buffering"] == "off"     # uploads stream to the spool
    assert a["nginx.ingress.kubernetes.io/proxy-read-timeout"] == "3600"
    assert a["nginx.ingress.kubernetes.io/proxy-body-size"] == "0"              # the platform's cap answers 413
    assert ing["spec"]["ingressClassName"] == "nginx" and ing["spec"]["tls"][0]["secretName"] == "lpx-tls"
    (rule,) = ing["spec"]["rules"]
    (path,) = rule["http"]["paths"]
    assert rule["host"] == "api.example.com" and path["path"] == "/" and path["pathType"] == "Prefix"
    assert path["backend"]["service"] == {"name": "lpx-loraplex-platform", "port": {"name": "http"}}


def test_alb_idle_timeout_stays_below_the_keep_alive():
    r = render({"ingress": {"enabled": True, "className": "alb", "hosts": [{"host": "api.example.com"}],
                            "annotations": {"alb.ingress.kubernetes.io/scheme": "internet-facing"}}})
    validate_all(r)
    a = r.one("Ingress", "-platform")["metadata"]["annotations"]
    assert a["alb.ingress.kubernetes.io/load-balancer-attributes"] == "idle_timeout.timeout_seconds=60"
    assert a["alb.ingress.kubernetes.io/scheme"] == "internet-facing"           # the operator's own kept
    assert a["alb.ingress.kubernetes.io/healthcheck-path"] == "/readyz"
    assert int(env_of(r.one("Deployment", "-platform"))["LORAPLEX_KEEP_ALIVE_S"]) > 60
    mine = render({"ingress": {"enabled": True, "className": "nginx", "hosts": [{"host": "a.example.com"}],
                               "annotations": {"nginx.ingress.kubernetes.io/proxy-read-timeout": "120"}}})
    assert mine.one("Ingress", "-platform")["metadata"]["annotations"][
        "nginx.ingress.kubernetes.io/proxy-read-timeout"] == "120"              # the operator's value wins
    with pytest.raises(helm.HelmRenderError, match="must be below keepAliveSeconds"):
        render({"ingress": {"enabled": True, "hosts": [{"host": "a.example.com"}], "idleTimeoutSeconds": 90}})
    raised = render({"keepAliveSeconds": 620, "ingress": {"enabled": True, "className": "alb",
                                                          "hosts": [{"host": "a.example.com"}],
                                                          "idleTimeoutSeconds": 600}})
    assert raised.one("Ingress", "-platform")["metadata"]["annotations"][
        "alb.ingress.kubernetes.io/load-balancer-attributes"] == "idle_timeout.timeout_seconds=600"


def test_httproute_attaches_to_the_gateway_with_streaming_timeouts():
    r = render({"httpRoute": {**EVERYTHING["httpRoute"], "labels": {"team": "ml"}}})
    validate_all(r)
    route = r.one("HTTPRoute", "-platform")
    assert route["spec"]["parentRefs"] == EVERYTHING["httpRoute"]["parentRefs"]
    assert route["spec"]["hostnames"] == ["api.example.com"] and route["metadata"]["labels"]["team"] == "ml"
    (rule,) = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    assert rule["backendRefs"] == [{"name": "lpx-loraplex-platform", "port": 80}]
    assert rule["timeouts"] == {"request": "3600s", "backendRequest": "3600s"}   # not a gateway's 15 s default
    off = {"request": "0s", "backendRequest": "0s"}                               # "0s": no timeout at all
    no_limit = render({"httpRoute": {**EVERYTHING["httpRoute"], "timeouts": off}})
    assert no_limit.one("HTTPRoute", "-platform")["spec"]["rules"][0]["timeouts"] == off
    with pytest.raises(helm.HelmRenderError, match="parentRefs"):
        render({"httpRoute": {"enabled": True, "parentRefs": [], "hostnames": []}})
    with pytest.raises(helm.HelmValuesError, match="request"):
        render({"httpRoute": {**EVERYTHING["httpRoute"], "timeouts": {"request": "1 hour"}}})


def test_the_crd_schemas_refuse_what_the_apis_refuse():
    """The hand-written CRD schemas can fail: an unknown field, a bad duration, a bad metric type."""
    route = render({"httpRoute": EVERYTHING["httpRoute"]}).one("HTTPRoute", "-platform")
    for broken in ({**route, "spec": {**route["spec"], "hostname": ["x"]}},
                   {**route, "spec": {**route["spec"], "rules": [{**route["spec"]["rules"][0],
                                                                  "timeouts": {"request": "1h30"}}]}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, HTTPROUTE_V1)
    so = render({"engine": {"autoscaling": {"enabled": True, "mode": "keda"}}}).one("ScaledObject", "-engine")
    trigger = {**so["spec"]["triggers"][0], "metricType": "Average"}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**so, "spec": {**so["spec"], "triggers": [trigger]}}, SCALEDOBJECT_V1ALPHA1)


# ------------------------------------------------------------------------------- keep-alive, engine metric names


def test_both_servers_get_the_keep_alive_and_the_platform_parses_it(monkeypatch):
    from loraplex.platform.core.config import Settings

    r = render({"keepAliveSeconds": 90})
    platform_env, engine_env = env_of(r.one("Deployment", "-platform")), env_of(r.one("StatefulSet", "-engine"))
    assert platform_env["LORAPLEX_KEEP_ALIVE_S"] == engine_env["LORAPLEX_KEEP_ALIVE_S"] == "90"
    monkeypatch.setenv("LORAPLEX_KEEP_ALIVE_S", platform_env["LORAPLEX_KEEP_ALIVE_S"])
    assert Settings(_env_file=None).keep_alive_s == 90
    assert env_of(render({}).one("StatefulSet", "-engine"))["LORAPLEX_KEEP_ALIVE_S"] == "75"
    with pytest.raises(helm.HelmValuesError, match="keepAliveSeconds"):
        render({"keepAliveSeconds": 0})


def test_vllm_compatible_engine_metrics_are_opt_in():
    assert "LORAPLEX_ENGINE_VLLM_METRICS" not in env_of(render({}).one("StatefulSet", "-engine"))
    on = render({"engine": {"metrics": {"vllmCompatibleNames": True}}})
    assert env_of(on.one("StatefulSet", "-engine"))["LORAPLEX_ENGINE_VLLM_METRICS"] == "1"


def test_engine_batch_and_adapter_caps_default_to_what_the_engine_derives(monkeypatch):
    from loraplex.engine.engine_config import CUDA_MAX_NUM_SEQS, EngineConfig, with_device_defaults

    r = render({})
    args = r.one("StatefulSet", "-engine")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not {"--max-num-seqs", "--max-loras", "--adapter-memory", "--adapter-memory-fraction"} & set(args)
    kw = engine_config_of(r, monkeypatch)
    assert (kw["max_num_seqs"], kw["max_loras"], kw["adapter_memory_bytes"]) == (None, None, None)
    config = EngineConfig(model="/m", **{k: v for k, v in kw.items() if k != "model_name"})
    assert config.adapter_memory_fraction == EngineConfig(model="/m").adapter_memory_fraction
    assert with_device_defaults(config, "cuda").max_num_seqs == CUDA_MAX_NUM_SEQS == 256


@pytest.mark.parametrize("memory,expected", [(25769803776, 24 << 30), ("24Gi", 24 << 30), ("500MB", 500_000_000)])
def test_engine_batch_adapter_caps_and_adapter_memory_reach_the_engine(memory, expected, monkeypatch):
    r = render({"engine": {"maxNumSeqs": 128, "lora": {"maxLoras": 8, "adapterMemory": memory,
                                                       "adapterMemoryFraction": 0.5}}})
    validate_all(r)
    kw = engine_config_of(r, monkeypatch)
    assert (kw["max_num_seqs"], kw["max_loras"], kw["adapter_memory_bytes"], kw["adapter_memory_fraction"]) == \
        (128, 8, expected, 0.5)


@pytest.mark.parametrize("engine,key", [
    ({"maxNumSeqs": 0}, "maxNumSeqs"),
    ({"lora": {"maxLoras": 0}}, "maxLoras"),
    ({"lora": {"adapterMemory": "lots"}}, "adapterMemory"),
    ({"lora": {"adapterMemory": 0}}, "adapterMemory"),
    ({"lora": {"adapterMemoryFraction": 1.0}}, "adapterMemoryFraction"),
    ({"lora": {"adapterMemoryFraction": 0}}, "adapterMemoryFraction"),
])
def test_engine_batch_and_adapter_knobs_are_checked(engine, key):
    with pytest.raises(helm.HelmValuesError, match=key):
        render({"engine": engine})
