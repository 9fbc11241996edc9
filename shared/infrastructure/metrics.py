"""Prometheus metrics: one registry per process, named ``sbx_*``, exposed on ``/metrics``.

The gateway serves them on its HTTP port; every other service on
``SBX_METRICS_PORT`` when set (``sbx up`` gives each service its own port and lists
them in ``sbx status``). No metric carries a secret, a session's commands or outputs.
"""

from __future__ import annotations

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)

REGISTRY = CollectorRegistry(auto_describe=True)
for _standard in (PROCESS_COLLECTOR, GC_COLLECTOR, PLATFORM_COLLECTOR):
    # (process_* CPU, memory, fds; python_gc_*; python_info: the client's standard set)
    REGISTRY.register(_standard)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

commands = Counter(
    "sbx_commands_total",
    "Session commands decided, by type and outcome.",
    ["type", "outcome"],
    registry=REGISTRY,
)
claims = Counter(
    "sbx_claims_total",
    "Sandboxes given to sessions: warm (from the pool) or cold.",
    ["kind"],
    registry=REGISTRY,
)
claim_seconds = Histogram(
    "sbx_claim_seconds", "Time to get a session a running sandbox.", ["kind"], buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)  # fmt: skip
pause_seconds = Histogram(
    "sbx_pause_seconds", "Time to pause (freeze and record) or resume (thaw and record) a sandbox.",
    ["action"], buckets=LATENCY_BUCKETS, registry=REGISTRY,
)  # fmt: skip
snapshot_seconds = Histogram(
    "sbx_snapshot_seconds",
    "Snapshots: how long a sandbox was frozen while its files were copied (frozen), and the "
    "whole snapshot, copy, hash and record (total).",
    ["phase"], buckets=LATENCY_BUCKETS, registry=REGISTRY,
)  # fmt: skip
pool_sandboxes = Gauge(
    "sbx_pool_sandboxes",
    "Sandboxes by state, as the pool-manager last counted them.",
    ["state"],
    registry=REGISTRY,
)
pool_target = Gauge(
    "sbx_pool_target_idle",
    "Idle sandboxes each configured pool keeps now: its min_idle plus its recent peak demand "
    "(SBX_POOL_AUTOSIZE), up to SBX_POOL_MAX_IDLE.",
    ["pool"],
    registry=REGISTRY,
)
pool_demand = Gauge(
    "sbx_pool_demand_peak",
    "Most new sessions a configured pool served (claims and cold starts it fits) within "
    "SBX_POOL_HORIZON seconds of the last SBX_POOL_DEMAND_WINDOW.",
    ["pool"],
    registry=REGISTRY,
)
refusals = Counter("sbx_refusals_total", "Sandboxes refused by a limit.", ["limit"], registry=REGISTRY)
image_requests = Counter(
    "sbx_image_requests_total",
    "Images a new sandbox needed: already on the machine (hit), pulled (miss), or failed.",
    ["result"],
    registry=REGISTRY,
)
image_pull_seconds = Histogram(
    "sbx_image_pull_seconds", "Time to pull an image from its registry.",
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600), registry=REGISTRY,
)  # fmt: skip
image_pull_bytes = Counter(
    "sbx_image_pull_bytes_total", "Bytes of image layers downloaded from registries.", registry=REGISTRY
)
evictions = Counter(
    "sbx_pool_evictions_total",
    "Idle pool sandboxes removed at max_running to make room for a session's own sandbox.",
    registry=REGISTRY,
)
reaps = Counter(
    "sbx_reaps_total",
    "Sessions paused (reason pause), stopped or purged by the reaper, by reason.",
    ["reason"],
    registry=REGISTRY,
)
audit_failures = Counter(
    "sbx_audit_failures_total",
    "Executor calls whose audit record could not be written (reported to the caller as errors).",
    registry=REGISTRY,
)
audit_refused = Counter(
    "sbx_audit_refused_total",
    "Executor calls refused because their session used its audit allowance (SBX_AUDIT_RATE).",
    registry=REGISTRY,
)
audit_trimmed_bytes = Counter(
    "sbx_audit_trimmed_bytes_total",
    "Bytes of audit records the reaper removed before their age (the stream near SBX_EVENTS_MAX_BYTES).",
    registry=REGISTRY,
)
events_bytes = Gauge(
    "sbx_events_bytes",
    "Bytes the event stream holds, as the reaper last saw (its limit: SBX_EVENTS_MAX_BYTES).",
    registry=REGISTRY,
)
reaper_pass_seconds = Histogram(
    "sbx_reaper_pass_seconds",
    "How long each reaper pass took (lifetime rules, the self-healing sweep, the audit trim).",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    registry=REGISTRY,
)
reconcile_findings = Counter(
    "sbx_reconcile_findings_total",
    "What the self-healing sweep fixed, by action.",
    ["action"],
    registry=REGISTRY,
)
exec_seconds = Histogram(
    "sbx_exec_seconds",
    "Executor request time, by tool.",
    ["tool"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
exec_cancelled = Counter(
    "sbx_exec_cancelled_total",
    "Tool calls stopped because their client cancelled or went away, by tool.",
    ["tool"],
    registry=REGISTRY,
)


exec_errors = Counter(
    "sbx_exec_errors_total",
    "Executor requests answered with an error, by tool and error code (internal: a crash).",
    ["tool", "code"],
    registry=REGISTRY,
)
http_requests = Counter(
    "sbx_http_requests_total",
    "Gateway HTTP requests, by route template, method and status.",
    ["route", "method", "status"],
    registry=REGISTRY,
)
http_seconds = Histogram(
    "sbx_http_request_seconds",
    "Gateway HTTP request time to the response's start, by route template and method.",
    ["route", "method"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
mcp_tool_calls = Counter(
    "sbx_mcp_tool_calls_total",
    "MCP tool calls, by tool and outcome (ok, error: the tool answered an error, cancelled).",
    ["tool", "outcome"],
    registry=REGISTRY,
)
mcp_tool_seconds = Histogram(
    "sbx_mcp_tool_seconds", "MCP tool call time, by tool.", ["tool"], buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)  # fmt: skip


def render() -> bytes:
    return generate_latest(REGISTRY)


def serve(port: int, host: str = "127.0.0.1") -> int:
    """Serve ``/metrics`` on ``port`` (0 picks a free one); returns the port."""
    server, _ = start_http_server(port, addr=host, registry=REGISTRY)
    return int(server.server_address[1])
