"""Every subject, stream, consumer and KV bucket name, in exactly one place.

All names hang off a *namespace* (``sbx`` by default) so that several stacks or
tests share one NATS server without seeing each other. Aggregate subjects embed
a :func:`shared.contract.ids.token`, never a raw user-supplied id.

Subjects (``<ns>`` is the namespace):

=================================  =============================================
``<ns>.evt.<kind>.<token>``        events of one aggregate: ``session``,
                                   ``instance``, ``sandbox``, ``proxy``,
                                   ``snapshot``; audit
                                   records: ``exec``, ``image``, ``egress``
``<ns>.cmd.session``               session commands, request/reply, queue group
                                   ``scheduler``
``<ns>.cmd.pool``                  provisioning requests, queue group
                                   ``pool-manager``
``<ns>.exec``                      tool calls and host API operations, queue
                                   group ``executor``
``<ns>.exec.prepare``              start a pool sandbox's shell server
``<ns>.exec.jobs``                 does a sandbox run async jobs (idle pause)
``<ns>.exec.stop.<token>.<run>``   stop a streamed operation
``<ns>.exec.cancel.<token>.<call>`` cancel a tool call (every executor listens)
``<ns>.pool.idle.<pool token>``    offers of idle pool sandboxes (work queue)
=================================  =============================================

Buckets: ``<ns>_sessions``, ``<ns>_instances``, ``<ns>_sandboxes``, ``<ns>_proxies``,
``<ns>_snapshots`` (projections), ``<ns>_health``, ``<ns>_activity``, ``<ns>_leases``,
``<ns>_audit_rate``.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.contract import ids

#: Header names, as NATS spells them.
MSG_ID = "Nats-Msg-Id"
EXPECTED_LAST_SUBJECT_SEQUENCE = "Nats-Expected-Last-Subject-Sequence"
MSG_TTL = "Nats-TTL"
"""A message's own expiry (seconds; NATS 2.11+, on a stream that allows it)."""

#: Aggregate kinds; each has its own subject space and projection bucket.
SESSION = "session"
INSTANCE = "instance"
SANDBOX = "sandbox"
EXEC = "exec"
"""Audit records of executions (not projected: the stream is the record)."""
PROXY = "proxy"
"""Credential proxies of the fleet (proxy-scaler)."""
IMAGE = "image"
"""Image pulls, per image reference (not projected: the stream is the record)."""
SNAPSHOT = "snapshot"
"""Snapshots of sessions' sandboxes (pool-manager)."""
EGRESS = "egress"
"""Sandbox connections through the proxy, per session (not projected: the stream is the
record)."""

#: Audit records: not projected (the stream is the record), each written with a TTL
#: (``Nats-TTL``), and the first to go when the stream nears its byte limit. The other
#: kinds are aggregates whose projections are the fold of all their events: never expire.
AUDIT_KINDS = (EXEC, IMAGE, EGRESS)

#: How long JetStream remembers a ``Nats-Msg-Id`` for de-duplication.
DUPLICATE_WINDOW_SECONDS = 120.0

#: Activity entries outlive any sensible idle timeout, then expire.
ACTIVITY_TTL_SECONDS = 7 * 86400.0

#: A lease not renewed within this long is free for another instance.
LEASE_TTL_SECONDS = 10.0

#: How long the audit-rate bucket keeps a session's level without a call (a full
#: allowance refills within a window, at most a day: expiry forgets nothing).
AUDIT_RATE_TTL_SECONDS = 86400.0

#: How long a heartbeat survives without renewal. Fixed (not a setting) because
#: every service creates the bucket and their definitions must agree.
HEALTH_TTL_SECONDS = 30.0


@dataclass(frozen=True)
class Topology:
    """Names for one namespace. Cheap to build; pass it around instead of strings."""

    namespace: str = "sbx"

    # ---- events --------------------------------------------------------------

    @property
    def events_stream(self) -> str:
        return f"{self.namespace.upper()}_EVENTS"

    @property
    def events_all(self) -> str:
        return f"{self.namespace}.evt.>"

    def events_of_kind(self, kind: str) -> str:
        return f"{self.namespace}.evt.{kind}.*"

    def aggregate_subject(self, kind: str, aggregate_id: str) -> str:
        return f"{self.namespace}.evt.{kind}.{ids.token(aggregate_id)}"

    def subject_of_key(self, kind: str, key: str) -> str:
        """The aggregate subject behind a projection key (the key *is* the token)."""
        return f"{self.namespace}.evt.{kind}.{key}"

    def kind_of(self, subject: str) -> str:
        return subject.split(".")[2]

    # ---- commands ------------------------------------------------------------

    @property
    def session_commands(self) -> str:
        return f"{self.namespace}.cmd.session"

    @property
    def exec_requests(self) -> str:
        """Executor requests (shell, jobs, edits); queue group ``executor``."""
        return f"{self.namespace}.exec"

    @property
    def exec_prepare(self) -> str:
        """Pool-manager → executor: prepare a pool sandbox (its shell server); queue ``executor``."""
        return f"{self.namespace}.exec.prepare"

    @property
    def exec_jobs(self) -> str:
        """Scheduler → executor: does a sandbox run async jobs (before an idle pause); queue ``executor``."""
        return f"{self.namespace}.exec.jobs"

    def exec_stop(self, session_id: str, run_id: str) -> str:
        """Where to publish to stop one streamed operation (any gateway can)."""
        return f"{self.namespace}.exec.stop.{ids.token(session_id)}.{run_id}"

    def exec_cancel(self, session_id: str, call_id: str) -> str:
        """Where to publish to cancel one tool call (its client cancelled or went away)."""
        return f"{self.namespace}.exec.cancel.{ids.token(session_id)}.{call_id}"

    @property
    def exec_cancels(self) -> str:
        """What every executor subscribes to for cancellations."""
        return f"{self.namespace}.exec.cancel.>"

    @property
    def pool_requests(self) -> str:
        """Provisioning requests to the pool-manager; queue group ``pool-manager``."""
        return f"{self.namespace}.cmd.pool"

    # ---- KV buckets ----------------------------------------------------------

    @property
    def checkpoints_bucket(self) -> str:
        """The object store of projection checkpoints (``<ns>_checkpoints``)."""
        return f"{self.namespace}_checkpoints"

    def bucket(self, kind: str) -> str:
        """The projection bucket of an aggregate kind (``<ns>_sessions``, ``<ns>_sandboxes``)."""
        return f"{self.namespace}_{PLURALS[kind]}"

    def legacy_bucket(self, kind: str) -> str:
        """The name a projection bucket had before 0.2 (``<ns>_sandboxs``, ``<ns>_proxys``);
        ``ensure_topology`` moves what such a bucket holds into ``bucket(kind)``."""
        return f"{self.namespace}_{kind}s"

    @property
    def health_bucket(self) -> str:
        """Liveness reports (not a projection: entries expire, they are not state)."""
        return f"{self.namespace}_health"

    def projector_consumer(self, kind: str) -> str:
        """Durable pull consumer that keeps a projection caught up."""
        return f"projector_{kind}"

    # ---- warm pool -------------------------------------------------------------

    @property
    def pool_stream(self) -> str:
        """Work queue of idle, ready pool sandboxes waiting to be claimed."""
        return f"{self.namespace.upper()}_POOL"

    def pool_offers(self, pool_id: str) -> str:
        return f"{self.namespace}.pool.idle.{ids.token(pool_id)}"

    def every_pool_offers(self) -> str:
        """The subjects of every pool's offers (a filter)."""
        return f"{self.namespace}.pool.idle.*"

    def claims_consumer(self, pool_id: str) -> str:
        return f"claims_{ids.token(pool_id)}"

    @property
    def activity_bucket(self) -> str:
        """Last tool call per session (and until when a call in flight may run): the
        reaper's idle clock. Not a projection: it is a timestamp, not a state change."""
        return f"{self.namespace}_activity"

    @property
    def audit_rate_bucket(self) -> str:
        """How much audit text each session caused lately (the executor's rate limit)."""
        return f"{self.namespace}_audit_rate"

    @property
    def leases_bucket(self) -> str:
        """Short leases for work only one instance should do at a time (pool refill)."""
        return f"{self.namespace}_leases"


PROJECTED_KINDS = (SESSION, INSTANCE, SANDBOX, PROXY, SNAPSHOT)
PLURALS = {
    SESSION: "sessions",
    INSTANCE: "instances",
    SANDBOX: "sandboxes",
    PROXY: "proxies",
    SNAPSHOT: "snapshots",
}
