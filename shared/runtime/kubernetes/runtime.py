"""The Kubernetes runtime backend (kubernetes-asyncio): see ``manifests`` for the objects
and ``channel`` for exec. Readiness and removal are awaited with watches, never polled.

State lives only in the cluster: the workspace claim (with the spec in an annotation) is
the record of a sandbox, so any instance of any service finds every sandbox again with a
label query. Root filesystem changes live in the pod and are lost on stop; the workspace
and ``/.sbx`` (session state) are on the claim and survive it.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import aiohttp
import msgspec
import structlog
from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client.exceptions import ApiException

from sbx_api import errors
from shared.contract import ids
from shared.infrastructure.settings.kubernetes import KubernetesSettings
from shared.runtime import api
from shared.runtime.kubernetes import channel, cluster, manifests, names, snapstore

TRUST_SETUP = f"""
[ -s {manifests.BUNDLE} ] && exit 0
system=/etc/ssl/certs/ca-certificates.crt
{{ cat $system 2>/dev/null; cat {manifests.CA_DIR}/proxy-ca.pem; }} > {manifests.BUNDLE}.new || exit 1
if [ -w $system ] && [ -w "${{system%/*}}" ]; then
  cp {manifests.BUNDLE}.new $system.new && mv -f $system.new $system
fi
mv -f {manifests.BUNDLE}.new {manifests.BUNDLE}
"""
"""Run by every start when egress goes through the proxy (a no-op once done): the trust
bundle every tool is pointed at, and the image's own store when the sandbox may write
it. Files are replaced by rename, so two starts at once cannot leave a torn one."""

FAIL_FAST = {"InvalidImageName", "CreateContainerConfigError", "CreateContainerError", "ErrImageNeverPull"}
PULL_FAILING = {"ErrImagePull", "ImagePullBackOff"}
PULL_GRACE = 15.0
"""How long the kubelet may go on failing to pull a sandbox's image (it retries with a
back-off) before the start fails with the registry's reason."""


def _body(manifest: dict[str, Any]) -> Any:
    """A manifest as a request body: the client serializes plain dicts as they are
    (``sanitize_for_serialization``), so manifests stay dicts; its generated signatures
    name the model classes."""
    return manifest


class KubernetesRuntime(api.Runtime):
    name = "kubernetes"

    def __init__(
        self,
        settings: KubernetesSettings,
        *,
        egress: str = "none",
        configuration: client.Configuration | None = None,
    ) -> None:
        self.settings = settings
        self.egress = egress
        self.ns = settings.namespace
        self.cluster = cluster.Cluster(settings, configuration)
        self.call = self.cluster.call
        self.volume_snapshots = snapstore.VolumeSnapshots(settings, self.cluster)
        if not settings.runtime_class:
            structlog.get_logger(__name__).warning(
                "kubernetes.no_runtime_class",
                effect="sandboxes run on the node's default runtime (runc), without gVisor",
                fix="install gVisor and set SBX_K8S_RUNTIME_CLASS=gvisor",
            )

    async def close(self) -> None:
        await self.cluster.close()

    # ---- reading -------------------------------------------------------------------------

    @staticmethod
    def _gone(obj: Any) -> bool:
        return obj is None or obj.metadata.deletion_timestamp is not None

    async def _claim(self, sandbox_id: str) -> Any:
        core = await self.cluster.core()
        claim = await self.call(
            "reading a workspace claim",
            core.read_namespaced_persistent_volume_claim(names.claim_name(sandbox_id), self.ns),
            missing_ok=True,
        )
        return None if self._gone(claim) else claim

    async def _pod(self, sandbox_id: str) -> Any:
        core = await self.cluster.core()
        return await self.call(
            "reading a sandbox pod",
            core.read_namespaced_pod(names.object_name(sandbox_id), self.ns),
            missing_ok=True,
        )

    @staticmethod
    def _owned_by(pod: Any, claim: Any) -> bool:
        return any(o.uid == claim.metadata.uid for o in pod.metadata.owner_references or [])

    @staticmethod
    def _running(pod: Any) -> bool:
        if pod is None or pod.metadata.deletion_timestamp is not None or pod.status is None:
            return False
        ready = [s.ready for s in pod.status.container_statuses or [] if s.name == names.CONTAINER]
        return pod.status.phase == "Running" and ready == [True]

    def _info(self, claim: Any, pod: Any) -> api.SandboxInfo:
        annotations = claim.metadata.annotations or {}
        try:
            spec = msgspec.json.decode(annotations[names.SPEC], type=api.SandboxSpec)
        except (KeyError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise errors.InfrastructureError(
                f"claim {claim.metadata.name} has no readable spec: {exc}"
            ) from None
        if self._running(pod):
            status: api.SandboxStatus = "running"
        elif annotations.get(names.PAUSED) == "true":
            status = "paused"
        else:
            status = "stopped" if annotations.get(names.STARTED) == "true" else "created"
        created = claim.metadata.creation_timestamp or datetime.now(UTC)
        return api.SandboxInfo(spec=spec, status=status, created_at=created, backend=self.name)

    async def get(self, sandbox_id: str) -> api.SandboxInfo | None:
        claim = await self._claim(sandbox_id)
        if claim is None:
            return None
        return self._info(claim, await self._pod(sandbox_id))

    async def _require(self, sandbox_id: str) -> Any:
        claim = await self._claim(sandbox_id)
        if claim is None:
            raise errors.NotFound(f"no sandbox {sandbox_id!r}")
        return claim

    async def list(self, labels: Mapping[str, str] | None = None) -> list[api.SandboxInfo]:
        core = await self.cluster.core()
        selector = names.selector(labels)
        claims = await self.call(
            "listing workspace claims",
            core.list_namespaced_persistent_volume_claim(self.ns, label_selector=selector),
        )
        pods = await self.call(
            "listing sandbox pods", core.list_namespaced_pod(self.ns, label_selector=selector)
        )
        by_token = {(p.metadata.labels or {}).get(names.SANDBOX): p for p in pods.items}
        out = []
        for claim in claims.items:
            if self._gone(claim):
                continue
            try:
                info = self._info(claim, by_token.pop((claim.metadata.labels or {}).get(names.SANDBOX), None))
            except errors.InfrastructureError as exc:  # one bad record must not hide the rest
                structlog.get_logger(__name__).warning("kubernetes.unreadable_claim", error=exc.message)
                continue
            if all(info.spec.labels.get(k) == v for k, v in (labels or {}).items()):
                out.append(info)
        if not labels:  # pods whose claim is gone or going: orphans for the sweep to delete
            for pod in by_token.values():
                sandbox_id = (pod.metadata.annotations or {}).get(names.SANDBOX_ID)
                if sandbox_id and pod.metadata.deletion_timestamp is None:
                    created = pod.metadata.creation_timestamp or datetime.now(UTC)
                    spec = api.SandboxSpec(sandbox_id=sandbox_id)
                    out.append(
                        api.SandboxInfo(spec=spec, status="running", created_at=created, backend=self.name)
                    )
        return out

    # ---- watching ------------------------------------------------------------------------

    async def _watch_pod(
        self, sandbox_id: str, since: str | None, deadline: float
    ) -> AsyncGenerator[tuple[str, Any], None]:
        """Events of one pod from ``since`` on, until ``deadline``; restarts from a fresh
        read when the server says the version is too old (410)."""
        core = await self.cluster.core()
        name = names.object_name(sandbox_id)
        while (left := deadline - time.monotonic()) > 0:
            if since is None:
                listed = await self.call(
                    "listing a sandbox pod",
                    core.list_namespaced_pod(self.ns, field_selector=f"metadata.name={name}"),
                )
                since = listed.metadata.resource_version
                yield "SNAPSHOT", (listed.items[0] if listed.items else None)
            stream = watch.Watch().stream(
                core.list_namespaced_pod,
                self.ns,
                field_selector=f"metadata.name={name}",
                resource_version=since,
                timeout_seconds=max(1, int(left)),
                allow_watch_bookmarks=False,
            )
            try:
                async for event in stream:
                    since = event["object"].metadata.resource_version or since
                    yield event["type"], event["object"]
            except ApiException as exc:
                if exc.status != 410:
                    raise cluster.api_error(exc, "watching a sandbox pod") from None
                since = None  # expired: start over from a fresh list
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise errors.Unavailable(f"watching a sandbox pod: {exc}") from exc
            finally:
                await stream.close()

    async def _until_ready(self, sandbox_id: str, since: str | None) -> None:
        deadline = time.monotonic() + self.settings.start_timeout
        last = "no status yet"
        failing_since: float | None = None  # when the kubelet started failing to pull the image
        async with contextlib.aclosing(self._watch_pod(sandbox_id, since, deadline)) as events:
            while True:
                grace = None if failing_since is None else failing_since + PULL_GRACE - time.monotonic()
                try:
                    async with asyncio.timeout(grace):
                        kind, pod = await anext(events)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    raise errors.InvalidInput(
                        f"sandbox {sandbox_id!r}: its image cannot be pulled ({last[:500]})"
                    ) from None
                if kind == "DELETED" or (kind == "SNAPSHOT" and pod is None):
                    raise errors.InfrastructureError(
                        f"sandbox {sandbox_id!r}: its pod was deleted while starting"
                    )
                if self._running(pod):
                    return
                last, fatal = self._why_not_ready(pod)
                if fatal:
                    raise errors.InfrastructureError(f"sandbox {sandbox_id!r} cannot start: {last}")
                pulling_fails = last.split(":", 1)[0] in PULL_FAILING
                failing_since = (failing_since or time.monotonic()) if pulling_fails else None
        raise errors.Timeout(
            f"sandbox {sandbox_id!r} not ready after {self.settings.start_timeout:.0f}s "
            f"(SBX_K8S_START_TIMEOUT): {last}"
        )

    @staticmethod
    def _why_not_ready(pod: Any) -> tuple[str, bool]:
        status = pod.status
        if status is None:
            return "pending", False
        if status.phase in ("Failed", "Succeeded"):
            return f"pod {status.phase.lower()}: {status.message or status.reason or ''}".strip(), True
        for cs in status.container_statuses or []:
            waiting = cs.state.waiting if cs.state else None
            if waiting is not None and waiting.reason:
                return f"{waiting.reason}: {waiting.message or ''}".strip(), waiting.reason in FAIL_FAST
        for cond in status.conditions or []:
            if cond.type == "PodScheduled" and cond.status == "False":
                return f"unschedulable: {cond.message or cond.reason}", False
        return f"phase {status.phase}", False

    async def _until_gone(self, sandbox_id: str, pod: Any, timeout: float = 60.0) -> None:
        if pod is None:
            return
        deadline = time.monotonic() + timeout
        async with contextlib.aclosing(
            self._watch_pod(sandbox_id, pod.metadata.resource_version, deadline)
        ) as events:
            async for kind, seen in events:
                if kind == "DELETED" or (kind == "SNAPSHOT" and seen is None):
                    return
                if seen is not None and seen.metadata.uid != pod.metadata.uid:
                    return  # the old pod is gone; a new one replaced it
        raise errors.Timeout(f"sandbox {sandbox_id!r}: its pod did not go away within {timeout:.0f}s")

    # ---- lifecycle -----------------------------------------------------------------------

    async def create(self, spec: api.SandboxSpec) -> api.SandboxInfo:
        ids.validate_session_id(spec.sandbox_id, what="sandbox id")
        if spec.snapshot is not None:
            await self.volume_snapshots.check_usable(spec)
        if spec.isolation == "strong" and not self.settings.strong_runtime_class:
            raise errors.NotBuiltYet(
                "strong isolation (Kata) is not configured on this cluster: set SBX_K8S_STRONG_RUNTIME_CLASS"
            )
        if spec.limits.memory_bytes < 16 * 1024**2 or spec.limits.pids < 8 or spec.limits.cpus <= 0:
            raise errors.InvalidInput("limits too small: at least 16 MiB memory, 8 pids and some CPU")
        self._image(spec)
        if spec.cache:
            await self._ensure_cache(spec.cache, creating=True)
        core = await self.cluster.core()
        for _ in range(2):
            existing = await self.call(
                "reading a workspace claim",
                core.read_namespaced_persistent_volume_claim(names.claim_name(spec.sandbox_id), self.ns),
                missing_ok=True,
            )
            if existing is not None and existing.metadata.deletion_timestamp is not None:
                raise errors.Conflict(
                    f"sandbox {spec.sandbox_id!r} is still being deleted; try again shortly"
                )
            if existing is not None:
                info = self._info(existing, None)
                if info.spec != spec:
                    raise errors.Conflict(f"sandbox {spec.sandbox_id!r} exists with a different spec")
                return self._info(existing, await self._pod(spec.sandbox_id))
            try:
                created = await self.call(
                    "creating a workspace claim",
                    core.create_namespaced_persistent_volume_claim(
                        self.ns, _body(manifests.workspace_claim(spec, self.settings))
                    ),
                )
            except errors.Conflict:
                continue  # someone created it first: compare with theirs
            return self._info(created, None)
        raise errors.Conflict(f"sandbox {spec.sandbox_id!r} is being created and deleted concurrently")

    # ---- per-organisation package caches ------------------------------------------------

    @property
    def tenant_caches(self) -> bool:  # type: ignore[override]  # a class attribute in the API
        """On when a ReadWriteMany StorageClass is configured (SBX_K8S_CACHE_STORAGE_CLASS)."""
        return bool(self.settings.cache_storage_class)

    async def _ensure_cache(self, key: str, *, creating: bool) -> None:
        """The organisation's cache claim, made with its first sandbox (and again if an
        operator deleted it); kept afterwards. An existing one is used even with caches
        turned off since, so stopped sandboxes still start."""
        try:
            name = names.cache_claim_name(key)
        except ValueError as exc:
            raise errors.InvalidInput(str(exc)) from None
        core = await self.cluster.core()
        existing = await self.call(
            "reading a package cache claim",
            core.read_namespaced_persistent_volume_claim(name, self.ns),
            missing_ok=True,
        )
        if existing is not None and existing.metadata.deletion_timestamp is not None:
            raise errors.Unavailable("this organisation's package cache is being deleted; retry shortly")
        if existing is not None:
            return
        if not self.tenant_caches:
            why = "per-organisation package caches need SBX_K8S_CACHE_STORAGE_CLASS (a ReadWriteMany class)"
            if creating:
                raise errors.ConfigError(why)
            raise errors.NotFound(f"this sandbox's package cache is gone and cannot be made again: {why}")
        try:
            await self.call(
                "creating a package cache claim",
                core.create_namespaced_persistent_volume_claim(
                    self.ns, _body(manifests.cache_claim(key, self.settings))
                ),
            )
        except errors.Conflict:
            pass  # another sandbox of the organisation made it first

    async def attach_cache(self, sandbox_id: str, key: str) -> bool:
        """A pod's volumes are fixed when it is created, so a sandbox shows the cache it
        was created with (``SandboxSpec.cache``) and no other: False if that is ``key``;
        Conflict if it is another organisation's; NotBuiltYet if it was created without
        one (the call goes on without a cache: claim from a pool of the organisation)."""
        spec = self._info(await self._require(sandbox_id), None).spec
        if spec.cache == key:
            return False
        if spec.cache:
            raise errors.Conflict("this sandbox already shows another organisation's cache")
        raise errors.NotBuiltYet(
            "on Kubernetes a sandbox's package cache is mounted when its pod is created, and this "
            "one was made without one (a shared pool's); an organisation's pool (SBX_POOLS \"org\") "
            "or a cold start gives one"
        )

    def _image(self, spec: api.SandboxSpec) -> str:
        image = self.settings.image(spec.image)
        ids.validate_image(image)
        return image

    async def start(self, sandbox_id: str) -> api.SandboxInfo:
        core = await self.cluster.core()
        claim = await self._require(sandbox_id)
        info = self._info(claim, None)
        pod = await self._pod(sandbox_id)
        if self._running(pod) and self._owned_by(pod, claim):
            await self._ensure_trust(sandbox_id)  # a start that died half-way is finished here
            if info.status == "paused":  # (a pause or resume that died half-way)
                await self._mark_paused(sandbox_id, False)
            return self._info(await self._require(sandbox_id), pod)
        if pod is not None and not self._owned_by(pod, claim):  # left from an earlier claim
            await self._delete_pod(sandbox_id)
            await self._until_gone(sandbox_id, pod)
            pod = None
        if (claim.metadata.annotations or {}).get(names.STARTED) != "true":
            # Before the pod exists: a sandbox that ever had one is "stopped", not "created".
            await self.call(
                "marking a workspace claim started",
                core.patch_namespaced_persistent_volume_claim(
                    names.claim_name(sandbox_id),
                    self.ns,
                    {"metadata": {"annotations": {names.STARTED: "true"}}},
                ),
            )
        if pod is not None and (
            pod.metadata.deletion_timestamp is not None or pod.status.phase in ("Failed", "Succeeded")
        ):
            await self._delete_pod(sandbox_id)
            await self._until_gone(sandbox_id, pod)
            pod = None
        raw = await self.cluster.as_dict(claim)
        policy = manifests.network_policy(info.spec, raw, self.settings, egress=self.egress)
        await self._ensure_policy(sandbox_id, policy, claim.metadata.uid)
        since = pod.metadata.resource_version if pod is not None else None
        if pod is None:
            if info.spec.cache:  # an operator may have deleted the cache since: an empty one, not a stuck pod
                await self._ensure_cache(info.spec.cache, creating=False)
            proxy = await self.cluster.proxy_url() if self.egress == "proxy" else None
            body = _body(
                manifests.pod(info.spec, raw, self.settings, image=self._image(info.spec), proxy_url=proxy)
            )
            try:
                created = await self.call("creating a sandbox pod", core.create_namespaced_pod(self.ns, body))
                since = created.metadata.resource_version
            except errors.Conflict:
                since = None  # another instance is starting it: wait with them
        await self._until_ready(sandbox_id, since)
        await self._ensure_trust(sandbox_id)
        if info.status == "paused":  # running again: no longer paused (after the start, so a
            await self._mark_paused(sandbox_id, False)  # start that dies leaves it paused)
        return msgspec.structs.replace(info, status="running")

    # ---- snapshots: CSI VolumeSnapshots of the workspace claim (snapstore.py) ----------------

    @property
    def snapshots(self) -> bool:  # type: ignore[override]  # a class attribute in the API
        return self.volume_snapshots.enabled

    async def snapshot(self, sandbox_id: str, snapshot_id: str) -> api.SnapshotInfo:
        """A VolumeSnapshot of the sandbox's workspace claim (``/workspace`` and the shell's
        saved state; crash-consistent: the CSI driver copies the volume as it is), ready
        when this returns. Idempotent by ``snapshot_id``."""

        async def spec() -> api.SandboxSpec:
            return self._info(await self._require(sandbox_id), None).spec

        return await self.volume_snapshots.take(sandbox_id, snapshot_id, spec)

    async def get_snapshot(self, snapshot_id: str) -> api.SnapshotInfo | None:
        return await self.volume_snapshots.get(snapshot_id)

    async def list_snapshots(self) -> builtins.list[api.SnapshotInfo]:
        return await self.volume_snapshots.list()

    async def delete_snapshot(self, snapshot_id: str) -> bool:
        """Delete the VolumeSnapshot. Claims provisioned from it are volumes of their own."""
        return await self.volume_snapshots.delete(snapshot_id)

    # ---- pause: scale to zero, the claim kept ---------------------------------------------

    pausable = True
    pause_keeps_processes = False  # a pod cannot be frozen through the API: files only

    async def _mark_paused(self, sandbox_id: str, paused: bool) -> None:
        core = await self.cluster.core()
        await self.call(
            "marking a workspace claim paused" if paused else "marking a workspace claim resumed",
            core.patch_namespaced_persistent_volume_claim(
                names.claim_name(sandbox_id),
                self.ns,
                {"metadata": {"annotations": {names.PAUSED: "true" if paused else None}}},
            ),
        )

    async def pause(self, sandbox_id: str) -> api.SandboxInfo:
        """Scale the sandbox to zero: its pod is deleted, its workspace claim (its files) kept
        and marked paused. Unlike the local runtime, its processes do not survive: a pod
        cannot be frozen through the API. :meth:`resume` (or ``start``) makes the pod again."""
        claim = await self._require(sandbox_id)
        pod = await self._pod(sandbox_id)
        info = self._info(claim, pod)
        if info.status == "paused":
            return info
        if info.status != "running":
            raise errors.NotRunning(f"sandbox {sandbox_id!r} is {info.status}: nothing to pause")
        await self._mark_paused(sandbox_id, True)  # first: a pause that dies leaves it paused, not lost
        await self._delete_pod(sandbox_id)
        await self._until_gone(sandbox_id, pod)
        return msgspec.structs.replace(info, status="paused")

    async def resume(self, sandbox_id: str) -> api.SandboxInfo:
        """Make the paused sandbox's pod again, on its kept claim (a running one: nothing to do)."""
        info = self._info(await self._require(sandbox_id), await self._pod(sandbox_id))
        if info.status == "running":
            return info
        if info.status != "paused":
            raise errors.NotRunning(f"sandbox {sandbox_id!r} is {info.status}, not paused")
        return await self.start(sandbox_id)

    async def paused(self, sandbox_id: str) -> bool:
        claim = await self._claim(sandbox_id)
        return claim is not None and (claim.metadata.annotations or {}).get(names.PAUSED) == "true"

    async def _ensure_trust(self, sandbox_id: str) -> None:
        if self.egress != "proxy":
            return
        result, _, err = await self.run(sandbox_id, ["/bin/sh", "-c", TRUST_SETUP], timeout=30)
        if result.exit_code != 0:
            raise errors.InfrastructureError(
                f"sandbox {sandbox_id!r}: installing the proxy CA failed: {err[-300:]!r}"
            )

    async def _ensure_policy(self, sandbox_id: str, policy: dict[str, Any], claim_uid: str) -> None:
        """Create the sandbox's NetworkPolicy; one left from an earlier claim of the same id
        (garbage collection lags) is replaced, never adopted."""
        net = await self.cluster.networking()
        name = names.object_name(sandbox_id)
        for _ in range(3):
            try:
                await self.call(
                    "creating a sandbox NetworkPolicy",
                    net.create_namespaced_network_policy(self.ns, _body(policy)),
                )
                return
            except errors.Conflict:
                pass
            existing = await self.call(
                "reading a sandbox NetworkPolicy",
                net.read_namespaced_network_policy(name, self.ns),
                missing_ok=True,
            )
            if existing is not None and any(
                o.uid == claim_uid for o in existing.metadata.owner_references or []
            ):
                return
            await self.call(
                "replacing a stale sandbox NetworkPolicy",
                net.delete_namespaced_network_policy(name, self.ns),
                missing_ok=True,
            )
        raise errors.Conflict(f"sandbox {sandbox_id!r}: its NetworkPolicy keeps changing")

    async def _delete_pod(self, sandbox_id: str) -> None:
        core = await self.cluster.core()
        await self.call(
            "deleting a sandbox pod",
            core.delete_namespaced_pod(names.object_name(sandbox_id), self.ns, grace_period_seconds=1),
            missing_ok=True,
        )

    async def stop(self, sandbox_id: str) -> api.SandboxInfo:
        claim = await self._require(sandbox_id)
        pod = await self._pod(sandbox_id)
        if pod is not None:
            await self._delete_pod(sandbox_id)
            await self._until_gone(sandbox_id, pod)
        if (claim.metadata.annotations or {}).get(names.PAUSED) == "true":  # stopped, no longer paused
            await self._mark_paused(sandbox_id, False)
            claim = await self._require(sandbox_id)
        return self._info(claim, None)  # no pod: "stopped", or "created" if it never ran

    async def delete(self, sandbox_id: str) -> None:
        core, net = await self.cluster.core(), await self.cluster.networking()
        pod = await self._pod(sandbox_id)
        if pod is not None:
            await self._delete_pod(sandbox_id)
        # Foreground: the garbage collector deletes the claim's pod and policy first. With
        # Background it would wait for the claim, which pvc-protection keeps while a pod
        # (one a racing start just made) uses it: neither would ever go.
        await self.call(
            "deleting a workspace claim",
            core.delete_namespaced_persistent_volume_claim(
                names.claim_name(sandbox_id), self.ns, propagation_policy="Foreground"
            ),
            missing_ok=True,
        )
        if pod is not None:
            await self._until_gone(sandbox_id, pod)
        await self.call(  # after the pod: the policy confines it until it is gone
            "deleting a sandbox NetworkPolicy",
            net.delete_namespaced_network_policy(names.object_name(sandbox_id), self.ns),
            missing_ok=True,
        )

    # ---- exec ----------------------------------------------------------------------------

    async def exec(
        self,
        sandbox_id: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | None = None,
        timeout: float | None = None,
        keep_stdin_open: bool = False,
    ) -> api.Exec:
        exec_id = channel.new_exec_id()
        one_shot = stdin if (stdin and not keep_stdin_open) else None
        command = channel.wrap(
            argv,
            exec_id=exec_id,
            cwd=cwd or "/workspace",
            env=env or {},
            stdin_bytes=len(one_shot) if one_shot is not None else None,
        )
        ws = await self._connect(sandbox_id, command, stdin=keep_stdin_open or one_shot is not None)

        async def kill() -> None:
            await self._kill(sandbox_id, exec_id)

        return channel.ChannelExec(
            ws,
            timeout=timeout,
            stdin=stdin,
            keep_stdin_open=keep_stdin_open,
            kill=kill,
            stdin_requested=keep_stdin_open or one_shot is not None,
        )

    async def _connect(
        self, sandbox_id: str, command: Sequence[str], *, stdin: bool
    ) -> aiohttp.ClientWebSocketResponse:
        ws_core = await self.cluster.exec_core()
        try:
            # With _preload_content=False the call returns the websocket, not the str the
            # generated signature says.
            return await ws_core.connect_get_namespaced_pod_exec(  # type: ignore[return-value]
                names.object_name(sandbox_id),
                self.ns,
                command=list(command),  # type: ignore[arg-type]  # one query parameter per argv element
                container=names.CONTAINER,
                stdin=stdin,
                stdout=True,
                stderr=True,
                tty=False,
                _preload_content=False,
            )
        except aiohttp.WSServerHandshakeError as exc:
            info = await self.get(sandbox_id)
            if info is None:
                raise errors.NotFound(f"no sandbox {sandbox_id!r}") from None
            if info.status != "running":
                raise errors.NotRunning(f"sandbox {sandbox_id!r} is {info.status}, not running") from None
            raise errors.Unavailable(
                f"exec into sandbox {sandbox_id!r} refused: {exc.status} {exc.message}"
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise errors.Unavailable(f"exec into sandbox {sandbox_id!r}: {exc}") from exc

    async def _kill(self, sandbox_id: str, exec_id: str) -> None:
        try:
            ws = await self._connect(sandbox_id, channel.killer(exec_id), stdin=False)
        except (errors.NotFound, errors.NotRunning):
            return  # the sandbox is gone or stopped: so is the command
        killing = channel.ChannelExec(
            ws, timeout=None, stdin=None, keep_stdin_open=False, kill=_nothing, stdin_requested=False
        )
        with contextlib.suppress(errors.SandboxError):
            await killing.wait()


async def _nothing() -> None:
    return None
