"""Strict JSON schemas of the two custom resources the chart can render, which kubernetes-validate (core APIs only)
does not know: Gateway API ``HTTPRoute`` (gateway.networking.k8s.io/v1, standard channel) and KEDA
``ScaledObject`` (keda.sh/v1alpha1). Written from those projects' API references and limited to the fields the
chart can emit -- any other field (a typo, a field of another version) fails, as kubernetes-validate's strict mode
does for core objects; value rules (duration format, enums, ranges) follow the references."""
from __future__ import annotations

_LABELS = {"type": "object", "additionalProperties": {"type": "string", "maxLength": 63}}
_METADATA = {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
    "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 253},
    "namespace": {"type": "string"}, "labels": _LABELS,
    "annotations": {"type": "object", "additionalProperties": {"type": "string"}}}}
_DURATION = {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}          # GEP-2257
_HOSTNAME = {"type": "string", "minLength": 1, "maxLength": 253,
             "pattern": r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"}
_NAME = {"type": "string", "minLength": 1, "maxLength": 253}

HTTPROUTE_V1 = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "gateway.networking.k8s.io/v1"}, "kind": {"const": "HTTPRoute"},
        "metadata": _METADATA,
        "spec": {"type": "object", "additionalProperties": False, "properties": {
            "parentRefs": {"type": "array", "minItems": 1, "maxItems": 32, "items": {
                "type": "object", "required": ["name"], "additionalProperties": False, "properties": {
                    "group": {"type": "string"}, "kind": {"type": "string"}, "namespace": {"type": "string"},
                    "name": _NAME, "sectionName": {"type": "string"},
                    "port": {"type": "integer", "minimum": 1, "maximum": 65535}}}},
            "hostnames": {"type": "array", "maxItems": 16, "items": _HOSTNAME},
            "rules": {"type": "array", "minItems": 1, "maxItems": 16, "items": {
                "type": "object", "additionalProperties": False, "properties": {
                    "matches": {"type": "array", "maxItems": 64, "items": {
                        "type": "object", "additionalProperties": False, "properties": {
                            "path": {"type": "object", "additionalProperties": False, "properties": {
                                "type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                                "value": {"type": "string", "pattern": "^/", "maxLength": 1024}}}}}},
                    "backendRefs": {"type": "array", "maxItems": 16, "items": {
                        "type": "object", "required": ["name"], "additionalProperties": False, "properties": {
                            "group": {"type": "string"}, "kind": {"type": "string"}, "name": _NAME,
                            "namespace": {"type": "string"},
                            "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                            "weight": {"type": "integer", "minimum": 0, "maximum": 1000000}}}},
                    "timeouts": {"type": "object", "additionalProperties": False,
                                 "properties": {"request": _DURATION, "backendRequest": _DURATION}}}}}}}}}

SCALEDOBJECT_V1ALPHA1 = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"}, "kind": {"const": "ScaledObject"}, "metadata": _METADATA,
        "spec": {"type": "object", "required": ["scaleTargetRef", "triggers"], "additionalProperties": False,
                 "properties": {
            "scaleTargetRef": {"type": "object", "required": ["name"], "additionalProperties": False,
                               "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                              "name": _NAME, "envSourceContainerName": {"type": "string"}}},
            "pollingInterval": {"type": "integer", "minimum": 1},
            "cooldownPeriod": {"type": "integer", "minimum": 0},
            "minReplicaCount": {"type": "integer", "minimum": 0},
            "maxReplicaCount": {"type": "integer", "minimum": 1},
            "advanced": {"type": "object", "additionalProperties": False, "properties": {
                "restoreToOriginalReplicaCount": {"type": "boolean"},
                "horizontalPodAutoscalerConfig": {"type": "object", "additionalProperties": False, "properties": {
                    "name": {"type": "string"},
                    "behavior": {"type": "object"}}}}},     # an autoscaling/v2 behavior: validated on the HPA
            "triggers": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["type", "metadata"], "additionalProperties": False, "properties": {
                    "type": {"type": "string", "minLength": 1}, "name": {"type": "string"},
                    "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                    "useCachedMetrics": {"type": "boolean"},
                    "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                    "authenticationRef": {"type": "object", "required": ["name"], "properties": {
                        "name": _NAME, "kind": {"enum": ["TriggerAuthentication",
                                                         "ClusterTriggerAuthentication"]}}}}}}}}}}

PROMETHEUS_TRIGGER_METADATA = {
    "type": "object", "required": ["serverAddress", "query", "threshold"], "properties": {
        "serverAddress": {"type": "string", "pattern": "^https?://"}, "query": {"type": "string", "minLength": 1},
        "threshold": {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"},
        "activationThreshold": {"type": "string"}}}
