"""The LeaderWorkerSet `leaderworkerset.x-k8s.io/v1` object as dyn renders it, as a JSON schema: the fields, types
and enumerations of the LWS v1 API (kubernetes-sigs/lws, releases 0.8 to 0.10), closed to fields the API does not
have, as kubectl's strict field validation is. The pod templates inside are validated apart, against Kubernetes'
own schemas (kubernetes-validate). Written here, not copied: the CRD file itself is not ours to commit."""

from __future__ import annotations

from typing import Any

LWS_API = "leaderworkerset.x-k8s.io/v1"

_INT_OR_STRING: dict[str, Any] = {
    "anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": "^[0-9]+%?$"}]
}


def _object(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        schema["required"] = list(required)
    return schema


_TEMPLATE = _object(
    {
        "size": {"type": "integer", "minimum": 1},
        "restartPolicy": {"enum": ["Default", "RecreateGroupOnPodRestart", "None"]},
        "leaderTemplate": {"type": "object"},
        "workerTemplate": {"type": "object"},
        "subGroupPolicy": _object(
            {"subGroupPolicyType": {"enum": ["LeaderWorker", "LeaderExcluded"]}, "subGroupSize": {"type": "integer"}}
        ),
        "volumeClaimTemplates": {"type": "array", "items": {"type": "object"}},
        "persistentVolumeClaimRetentionPolicy": _object(
            {"whenDeleted": {"type": "string"}, "whenScaled": {"type": "string"}}
        ),
    },
    required=("workerTemplate",),
)

LWS_SCHEMA: dict[str, Any] = _object(
    {
        "apiVersion": {"enum": [LWS_API]},
        "kind": {"enum": ["LeaderWorkerSet"]},
        "metadata": {"type": "object"},
        "spec": _object(
            {
                "replicas": {"type": "integer", "minimum": 0},
                "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                "rolloutStrategy": _object(
                    {
                        "type": {"enum": ["RollingUpdate"]},
                        "rollingUpdateConfiguration": _object(
                            {
                                "maxSurge": _INT_OR_STRING,
                                "maxUnavailable": _INT_OR_STRING,
                                "partition": {"type": "integer"},
                            }
                        ),
                    }
                ),
                "leaderWorkerTemplate": _TEMPLATE,
                "networkConfig": _object({"subdomainPolicy": {"enum": ["Shared", "UniquePerReplica"]}}),
            },
            required=("leaderWorkerTemplate",),
        ),
    },
    required=("apiVersion", "kind", "metadata", "spec"),
)
"""The schema the rendered LeaderWorkerSets are checked against (jsonschema, draft 7)."""
