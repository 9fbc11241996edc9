"""E2B's control-plane JSON (spec/openapi.yml of e2b-dev/E2B), as far as it is served:
the fields the SDK sends and the fields it requires in answers (camelCase on the wire)."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

import msgspec

ENVD_VERSION = "0.5.7"
"""The envd version reported, which switches on in the SDK exactly what is served
(docs/e2b.md): a command's ``stdin`` (0.3.0), the default user (0.4.0: no username sent;
commands and files run as the sandbox's user), ``close_stdin`` (0.5.2) and octet-stream
uploads (0.5.7). Not 0.6.2: file metadata (extended attributes) is not served, nor the
watch features of 0.6.3 and later."""

CLIENT_ID = "sbx"
"""``clientID``: deprecated in E2B, still required by the SDK's models."""


class Error(msgspec.Struct, frozen=True):
    code: int
    message: str


class NewSandbox(msgspec.Struct, frozen=True, rename="camel"):
    """``POST /sandboxes`` and ``POST /v2/sandboxes`` (fields not listed are ignored)."""

    template_id: str = msgspec.field(name="templateID")
    timeout: int = 300
    metadata: dict[str, str] = {}
    env_vars: dict[str, str] = {}
    auto_pause: bool = False


class Connect(msgspec.Struct, frozen=True):
    timeout: int | None = None


class Timeout(msgspec.Struct, frozen=True):
    timeout: int


class SnapshotRequest(msgspec.Struct, frozen=True):
    name: str | None = None


class ForkRequest(msgspec.Struct, frozen=True):
    timeout: int | None = None
    count: int = 1


class Sandbox(msgspec.Struct, frozen=True, omit_defaults=True):
    """A created, connected or forked sandbox."""

    templateID: str
    sandboxID: str
    clientID: str
    envdVersion: str
    envdAccessToken: str | None = None
    domain: str | None = None


State = Literal["running", "paused"]


class ListedSandbox(msgspec.Struct, frozen=True):
    templateID: str
    sandboxID: str
    clientID: str
    startedAt: datetime
    endAt: datetime
    cpuCount: int
    memoryMB: int
    diskSizeMB: int
    state: State
    envdVersion: str
    metadata: dict[str, str]


class SandboxDetail(msgspec.Struct, frozen=True):
    templateID: str
    sandboxID: str
    clientID: str
    startedAt: datetime
    endAt: datetime
    cpuCount: int
    memoryMB: int
    diskSizeMB: int
    state: State
    envdVersion: str
    metadata: dict[str, str]
    domain: str


class SnapshotInfo(msgspec.Struct, frozen=True):
    snapshotID: str
    names: list[str]


class ForkResult(msgspec.Struct, frozen=True, omit_defaults=True):
    sandbox: Sandbox | None = None
    error: Error | None = None


class Metric(msgspec.Struct, frozen=True):
    """One ``GET /sandboxes/{id}/metrics`` entry (``SandboxMetric``): a reading taken now."""

    timestamp: datetime
    timestampUnix: int
    cpuCount: int
    cpuUsedPct: float
    memUsed: int
    memTotal: int
    memCache: int
    diskUsed: int
    diskTotal: int
