"""How sandboxes map to Kubernetes names, labels and annotations (pure).

A sandbox id is never used raw in a Kubernetes name or label: object names are
``sbx-`` + :func:`shared.contract.ids.token` of the id (valid DNS-1123 labels whatever the id),
and the id itself is kept in an annotation. Caller labels become labels under
``label.sbx.dev/`` with values hashed when they are not valid label values; ``list``
selects by label, then checks the exact values from the stored spec.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from shared.contract import ids

MANAGED_BY = "app.kubernetes.io/managed-by"
PRODUCT = "cloud-agent-sandbox"
COMPONENT = "app.kubernetes.io/component"
SANDBOX = "sbx.dev/sandbox"
"""Label on every object of one sandbox: the token of its id."""
SANDBOX_ID = "sbx.dev/sandbox-id"
"""Annotation: the sandbox id itself."""
SPEC = "sbx.dev/spec"
"""Annotation on the workspace claim: the SandboxSpec as JSON (what ``create`` was asked)."""
STARTED = "sbx.dev/started"
"""Annotation on the workspace claim once the sandbox has run (``stopped``, not ``created``)."""
PAUSED = "sbx.dev/paused"
"""Annotation on the workspace claim of a paused sandbox: scaled to zero (no pod), its
claim kept, ``paused`` until it is resumed or stopped."""
LABEL_PREFIX = "label.sbx.dev/"
CONTAINER = "sandbox"
PROXY_POD_LABEL = ("app.kubernetes.io/name", "sbx-proxy")

_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


SNAPSHOT = "sbx.dev/snapshot"
"""Label on a VolumeSnapshot of a workspace claim: the token of the snapshot's id."""
SNAPSHOT_ID = "sbx.dev/snapshot-id"
"""Annotation: the snapshot id itself."""
SNAPSHOT_OF = "sbx.dev/snapshot-of"
"""Annotation: what a sandbox started from the snapshot must be (JSON: sandbox id, image,
run_as_root, writable_root, parent)."""


def snapshot_name(snapshot_id: str) -> str:
    """Name of the VolumeSnapshot of a snapshot."""
    return f"sbx-{ids.token(snapshot_id)}-snap"


def snapshot_labels(snapshot_id: str, sandbox_id: str) -> dict[str, str]:
    """Labels of a VolumeSnapshot: never selected as a sandbox (another component)."""
    return {
        MANAGED_BY: PRODUCT,
        COMPONENT: "snapshot",
        SNAPSHOT: ids.token(snapshot_id),
        SANDBOX: ids.token(sandbox_id),
    }


SNAPSHOT_SELECTOR = f"{MANAGED_BY}={PRODUCT},{COMPONENT}=snapshot"


CACHE = "sbx.dev/cache"
"""Label on an organisation's package cache claim: its key (the organisation's token)."""
_CACHE_KEY = re.compile(r"[0-9a-f]{32}")


def cache_claim_name(key: str) -> str:
    """Name of the package cache claim of ``key`` (an organisation's token, 32 hex)."""
    if not _CACHE_KEY.fullmatch(key):
        raise ValueError("a cache key is the 32-hex token of an organisation")
    return f"sbx-cache-{key}"


def cache_labels(key: str) -> dict[str, str]:
    """Labels of a cache claim: never selected as a sandbox (another component)."""
    return {MANAGED_BY: PRODUCT, COMPONENT: "cache", CACHE: key}


def object_name(sandbox_id: str) -> str:
    """Name of the sandbox's pod and NetworkPolicy."""
    return f"sbx-{ids.token(sandbox_id)}"


def claim_name(sandbox_id: str) -> str:
    """Name of the sandbox's workspace PersistentVolumeClaim."""
    return f"sbx-{ids.token(sandbox_id)}-ws"


def label_key(key: str) -> str:
    if len(key) <= 63 and _LABEL_NAME.fullmatch(key):
        return LABEL_PREFIX + key
    return f"{LABEL_PREFIX}k-{ids.token(key)}"


def label_value(value: str) -> str:
    if len(value) <= 63 and _LABEL_VALUE.fullmatch(value):
        return value
    return f"v-{ids.token(value)}"


def labels(sandbox_id: str, caller: Mapping[str, str]) -> dict[str, str]:
    """The labels every object of a sandbox carries."""
    out = {MANAGED_BY: PRODUCT, COMPONENT: "sandbox", SANDBOX: ids.token(sandbox_id)}
    out.update({label_key(k): label_value(v) for k, v in caller.items()})
    return out


def selector(caller: Mapping[str, str] | None = None, *, sandbox_id: str | None = None) -> str:
    """A label selector for the product's sandboxes, narrowed by caller labels or one id."""
    terms = {MANAGED_BY: PRODUCT, COMPONENT: "sandbox"}
    if sandbox_id is not None:
        terms[SANDBOX] = ids.token(sandbox_id)
    terms.update({label_key(k): label_value(v) for k, v in (caller or {}).items()})
    return ",".join(f"{k}={v}" for k, v in terms.items())
