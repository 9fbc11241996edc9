"""A Kubernetes API server for the tests: kmock's emulator with its gaps filled, plus a
kubelet that runs every pod as a real local sandbox.

This is a faithful emulator, not a mock: the runtime under test speaks HTTP and the
pods/exec websocket to it exactly as it would to a cluster, and every command it runs
executes for real (in a bubblewrap sandbox standing in for the pod's container).

What kmock 0.8 lacks and is filled in here (see ../shared/design/environment.md):

* label selectors (``a=b``, ``a!=b``, ``a``, ``!a``) and field selectors
  (``metadata.name``, ``metadata.namespace``) on list and watch;
* ``watch=True`` (kubernetes-asyncio's spelling; kmock only knows ``true``);
* ``metadata.namespace``, ``uid``, ``creationTimestamp`` and a cluster-wide
  ``resourceVersion`` on every write; watches resume from a resourceVersion and answer
  410 Expired for one older than the retained history (``retained``), as etcd
  compaction makes a real server do; ``timeoutSeconds`` ends a watch;
* graceful pod deletion (``deletionTimestamp`` first, gone once the kubelet has stopped
  the containers; emulated with a kubelet finalizer), the ``pvc-protection`` finalizer
  (a claim in use by a pod stays until the pod is gone) and owner-reference garbage
  collection, Foreground (dependents first, ``foregroundDeletion``) or Background
  (dependents once the owner is gone; so a claim in use deleted in the background
  waits for its pod forever, as on a real cluster);
* pods/exec over a websocket speaking ``v5.channel.k8s.io``/``v4.channel.k8s.io``
  (``protocols`` restricts what the server accepts), byte for byte: empty frames open
  the channels, stdin on 0, output on 1/2, the exit Status on 3, v5's close frame; a
  client that hangs up closes the command's stdin and leaves it running, as a real
  kubelet does.

Pod to sandbox: the name of the claim mounted at /workspace is the local sandbox id (so
the workspace survives the pod); another claim, mounted at /.sbx/cache, is the node's
directory for that claim, shared by every pod that mounts it (the local runtime's
package cache keyed by the claim's name, so a claim deleted and made again keeps its
files here; a pod naming a claim that does not exist stays Pending, unschedulable, as on
a cluster); ``runAsUser`` 0 is ``run_as_root``; ``readOnlyRootFilesystem`` is the
opposite of ``writable_root``; the container's env and workingDir apply to every exec;
any image in ``images`` runs as the local default image, any other gets
``ErrImagePull``; configMap volumes are files written into the sandbox after it starts
(so only where the sandbox may write them). Pods without a workspace claim (the proxies)
are reported running and ready, with an address, but run nothing. Deployments are
reconciled to ``spec.replicas`` (pods from the template; the scale subresource reads and
patches it). Not emulated: scheduling, RuntimeClasses, NetworkPolicy enforcement,
admission, rollouts, RBAC enforcement (``calls`` records verb and resource of every
request so tests can check them against deploy/'s Roles).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import json
import re
import uuid
from datetime import UTC, datetime
from typing import Any

import aiohttp
import aiohttp.web
import attrs
import kmock
from kmock._internal import enums, rendering

from sbx_api import errors
from shared.contract import ids
from shared.runtime import api
from shared.runtime.local import runtime as local

KUBELET_FINALIZER = "emulator.sbx.dev/kubelet"
PVC_PROTECTION = "kubernetes.io/pvc-protection"
FOREGROUND = "foregroundDeletion"
EXEC_PATH = re.compile(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)/exec")
VERBS = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _selected(obj: dict[str, Any], labels: str | None, fields: str | None) -> bool:
    meta = obj.get("metadata", {})
    have = meta.get("labels") or {}
    for term in filter(None, (labels or "").split(",")):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if have.get(k) == v:
                return False
        elif "=" in term:
            k, v = term.split("=", 1)
            if have.get(k.rstrip("=")) != v:
                return False
        elif term.startswith("!"):
            if term[1:] in have:
                return False
        elif term not in have:
            return False
    for term in filter(None, (fields or "").split(",")):
        k, _, v = term.partition("=")
        if k == "metadata.name" and meta.get("name") != v:
            return False
        if k == "metadata.namespace" and meta.get("namespace") != v:
            return False
    return True


class _Recorder(dict):  # type: ignore[type-arg]
    """Stands in for kmock's per-resource buses: every event gets the next
    resourceVersion, is logged for watches, and wakes the kubelet."""

    def __init__(self, owner: ClusterEmulator) -> None:
        super().__init__()
        self.owner = owner

    def __missing__(self, resource: Any) -> _Bus:
        bus = self[resource] = _Bus(self.owner, resource)
        return bus


class _Bus:
    def __init__(self, owner: ClusterEmulator, resource: Any) -> None:
        self.owner, self.resource = owner, resource

    async def put(self, event: dict[str, Any]) -> None:
        self.owner._record(self.resource, event)


@attrs.define(kw_only=True)
class ClusterEmulator(kmock.KubernetesEmulator):
    images: frozenset[str] = frozenset()
    """Image references that "pull"; every other one fails with ErrImagePull."""
    protocols: tuple[str, ...] = ("v5.channel.k8s.io", "v4.channel.k8s.io")
    retained: int = 10_000
    """Events kept for watches that resume; older versions get 410 Expired."""
    state_dir: Any = None
    calls: list[tuple[str, str, str | None]] = attrs.field(factory=list)
    """(verb, group/resource[/subresource], namespace) of every request, in order."""

    _rv: int = attrs.field(default=0, init=False)
    _log: collections.deque[tuple[int, Any, dict[str, Any]]] = attrs.field(
        factory=collections.deque, init=False
    )
    _changed: asyncio.Condition = attrs.field(factory=asyncio.Condition, init=False)
    _tasks: set[asyncio.Task[None]] = attrs.field(factory=set, init=False)
    _pod_locks: dict[str, asyncio.Lock] = attrs.field(
        factory=lambda: collections.defaultdict(asyncio.Lock), init=False
    )
    _runtime: Any = attrs.field(default=None, init=False)
    _expired_before: int = attrs.field(default=0, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._buses = _Recorder(self)
        self._runtime = local.LocalRuntime(self.state_dir)

    # ---- requests ------------------------------------------------------------------------

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        found = EXEC_PATH.fullmatch(raw_request.path)
        if found and raw_request.headers.get("Upgrade", "").lower() == "websocket":
            self.calls.append(("create", "pods/exec", found.group(1)))
            return await self._exec(raw_request, found.group(1), found.group(2))
        return await super().__call__(raw_request)

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        if (
            request.resource is not None
            and request.method == "GET"
            and request.params.get("watch") in ("True", "1")
        ):
            evolved = attrs.evolve(request, action=enums.action.WATCH)
            # kmock matches reactions against the requests it has logged: log this one instead.
            self._requests[:] = [evolved if r is request else r for r in self._requests]
            request = evolved
        if request.resource is not None:
            self._note(request)
            self._stamp(request)
            if request.action == enums.action.DELETE and request.name is not None:
                await self._deletion_policy(request)
        return await super()._handle(request)

    async def _deletion_policy(self, request: rendering.Request) -> None:
        """``propagationPolicy=Foreground`` puts the ``foregroundDeletion`` finalizer on the
        owner first (so its dependents go before it), as the API server does."""
        body = request.data if isinstance(request.data, dict) else {}
        policy = request.params.get("propagationPolicy") or body.get("propagationPolicy") or "Background"
        if policy != "Foreground":
            return
        async with self._lock:
            _, obj = self._find(request.resource.plural, request.namespace, request.name)
            if obj is not None:
                finalizers = obj.raw.get("metadata", {}).get("finalizers") or []
                if FOREGROUND not in finalizers:
                    obj.patch({"metadata": {"finalizers": [*finalizers, FOREGROUND]}})

    def _note(self, request: rendering.Request) -> None:
        group = request.resource.group or ""
        what = f"{group}/{request.resource.plural}".lstrip("/")
        if request.subresource:
            what += f"/{request.subresource}"
        if request.method == "GET":
            verb = "watch" if request.action == enums.action.WATCH else ("get" if request.name else "list")
        else:
            verb = VERBS.get(request.method, request.method.lower())
        self.calls.append((verb, what, request.namespace))

    def _stamp(self, request: rendering.Request) -> None:
        """What the API server adds to every write."""
        data = request.data if isinstance(request.data, dict) else None
        if request.action == enums.action.CREATE and data is not None:
            meta = data.setdefault("metadata", {})
            meta["namespace"] = request.namespace or meta.get("namespace")
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), resourceVersion=str(self._rv + 1))
            if request.resource.plural == "pods":
                meta["finalizers"] = [*meta.get("finalizers", []), KUBELET_FINALIZER]
                data["status"] = {
                    "phase": "Pending",
                    "conditions": [{"type": "PodScheduled", "status": "True"}],
                }
            if request.resource.plural == "persistentvolumeclaims":
                meta["finalizers"] = [*meta.get("finalizers", []), PVC_PROTECTION]
                data["status"] = {"phase": "Bound"}
        elif request.action == enums.action.UPDATE and data is not None:
            data.setdefault("metadata", {})["resourceVersion"] = str(self._rv + 1)

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        async with self._lock:
            items = self._select(request)
        return {
            "apiVersion": "v1",
            "kind": "List",
            "metadata": {"resourceVersion": str(self._rv)},
            "items": items,
        }

    def _select(self, request: rendering.Request) -> list[dict[str, Any]]:
        out = []
        for (resource, namespace, _), obj in self._objects.items():
            if resource != request.resource or obj.deleted:
                continue
            if request.namespace is not None and namespace != request.namespace:
                continue
            raw = obj.raw
            if _selected(raw, request.params.get("labelSelector"), request.params.get("fieldSelector")):
                out.append(copy.deepcopy(raw))
        return out

    def _matches(self, request: rendering.Request, resource: Any, obj: dict[str, Any]) -> bool:
        meta = obj.get("metadata", {})
        return (
            resource == request.resource
            and (request.namespace is None or meta.get("namespace") == request.namespace)
            and (request.name is None or meta.get("name") == request.name)
            and _selected(obj, request.params.get("labelSelector"), request.params.get("fieldSelector"))
        )

    async def _serve_watch(self, request: rendering.Request):  # type: ignore[no-untyped-def,override]
        yield b""
        loop = asyncio.get_running_loop()
        timeout = float(request.params.get("timeoutSeconds") or 3600)
        deadline = loop.time() + timeout
        since_raw = request.params.get("resourceVersion") or ""
        async with self._lock:
            if since_raw in ("", "0"):
                initial = [{"type": "ADDED", "object": o} for o in self._select(request)]
                since = self._rv
            else:
                since = int(since_raw)
                if since < self._expired_before:
                    code = {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "status": "Failure",
                        "code": 410,
                        "reason": "Expired",
                        "message": f"too old resource version: {since}",
                    }
                    yield {"type": "ERROR", "object": code}
                    return
                initial = []
        for event in initial:
            yield event
        while (left := deadline - loop.time()) > 0:
            pending = [
                (rv, e)
                for rv, res, e in list(self._log)
                if rv > since and self._matches(request, res, e["object"])
            ]
            for rv, event in pending:
                yield event
            since = max([since, *(rv for rv, _ in pending)])
            newest = self._rv
            if newest > since and not pending:
                since = newest
                continue
            async with self._changed:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(left):
                        await self._changed.wait_for(lambda s=since: self._rv > s)

    # ---- events and direct writes --------------------------------------------------------

    def _record(self, resource: Any, event: dict[str, Any], *, react: bool = True) -> None:
        obj = copy.deepcopy(event["object"])
        meta = obj.setdefault("metadata", {})
        rv = int(meta.get("resourceVersion") or 0)
        if rv <= self._rv:
            rv = self._rv + 1
            meta["resourceVersion"] = str(rv)
        self._rv = rv
        self._log.append((rv, resource, {"type": event["type"], "object": obj}))
        while len(self._log) > self.retained:
            self._expired_before = self._log.popleft()[0] + 1
        self._spawn(self._wake())
        if react:
            self._spawn(self._react(resource, event["type"], obj))

    async def _wake(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def expire_history(self) -> None:
        """Forget every event so far: watches resuming from before now get 410."""
        self._log.clear()
        self._expired_before = self._rv + 1

    def _find(self, plural: str, namespace: str, name: str) -> Any:
        for key, obj in self._objects.items():
            if key[0].plural == plural and key[1] == namespace and key[2] == name and not obj.deleted:
                return key, obj
        return None, None

    async def write(
        self, plural: str, namespace: str, name: str, patch: dict[str, Any], *, quiet: bool = False
    ) -> None:
        """Change a stored object as a controller would (with an event); finish its
        deletion once its last finalizer is gone."""
        async with self._lock:
            key, obj = self._find(plural, namespace, name)
            if obj is None:
                return
            patch = copy.deepcopy(patch)
            patch.setdefault("metadata", {})["resourceVersion"] = str(self._rv + 1)
            obj.patch(patch)
            raw = obj.raw
            self._record(key[0], {"type": "MODIFIED", "object": raw}, react=not quiet)
            meta = raw.get("metadata", {})
            if meta.get("deletionTimestamp") and not meta.get("finalizers"):
                obj.delete()
                self._record(key[0], {"type": "DELETED", "object": raw})

    async def remove_finalizer(self, plural: str, namespace: str, name: str, finalizer: str) -> None:
        _, obj = self._find(plural, namespace, name)
        if obj is not None:
            left = [f for f in obj.raw.get("metadata", {}).get("finalizers", []) if f != finalizer]
            await self.write(plural, namespace, name, {"metadata": {"finalizers": left or None}})

    async def close_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for (resource, _, _), obj in list(self._objects.items()):
            if resource.plural == "persistentvolumeclaims" and not obj.deleted:
                with contextlib.suppress(Exception):
                    await self._runtime.delete(obj.raw["metadata"]["name"])
        for info in await self._runtime.list():  # (pods whose claim went before them)
            with contextlib.suppress(Exception):
                await self._runtime.delete(info.sandbox_id)
        await asyncio.to_thread(self._runtime.caches.detach_all)  # the node's cache mounts

    # ---- the kubelet and the controllers -------------------------------------------------

    async def _react(self, resource: Any, kind: str, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        try:
            owner = next((o for o in meta.get("ownerReferences", []) if o.get("kind") == "Deployment"), None)
            if resource.plural == "pods" and kind == "DELETED" and owner is not None:
                async with self._pod_locks[f"deployment/{meta['namespace']}/{owner['name']}"]:
                    await self._reconcile_deployment(meta["namespace"], owner["name"])
            elif resource.plural == "pods":
                async with self._pod_locks[f"{meta['namespace']}/{meta['name']}"]:
                    if meta.get("deletionTimestamp") and KUBELET_FINALIZER in meta.get("finalizers", []):
                        await self._kill_pod(obj)
                    elif kind == "ADDED":
                        await self._run_pod(obj)
            elif resource.plural == "persistentvolumeclaims" and kind == "DELETED":
                for key, dependent in self._dependents(meta["uid"], meta["namespace"]):  # background GC
                    await self._collect(key[0], key, dependent)
            elif resource.plural == "persistentvolumeclaims" and meta.get("deletionTimestamp"):
                async with self._pod_locks[f"claim/{meta['namespace']}/{meta['name']}"]:
                    await self._collect_claim(obj)
            elif resource.plural == "volumesnapshots" and kind == "ADDED":
                await self._take_volume_snapshot(obj)
            elif resource.plural == "deployments" and kind in ("ADDED", "MODIFIED"):
                async with self._pod_locks[f"deployment/{meta['namespace']}/{meta['name']}"]:
                    await self._reconcile_deployment(meta["namespace"], meta["name"])
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if resource.plural == "pods":
                await self.write(
                    "pods",
                    meta["namespace"],
                    meta["name"],
                    {"status": {"phase": "Failed", "message": f"emulated kubelet: {exc}"}},
                )

    @staticmethod
    def _claim_of(pod: dict[str, Any], path: str = "/workspace") -> str | None:
        """The claim of the volume mounted at ``path`` (the workspace: the sandbox's id)."""
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        for mount in pod["spec"]["containers"][0].get("volumeMounts", []):
            volume = volumes.get(mount["name"], {})
            if mount["mountPath"] == path and "persistentVolumeClaim" in volume:
                return volume["persistentVolumeClaim"]["claimName"]
        return None

    def _shared_claims(self, pod: dict[str, Any]) -> tuple[str | None, str | None]:
        """(the local cache key standing for a claim mounted at the cache path, or None;
        why the pod cannot start, or None). Any claim other than the workspace is
        emulated only there: as the node's directory for that claim, which every pod
        mounting the same claim shares (a ReadWriteMany volume)."""
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        key = None
        for mount in pod["spec"]["containers"][0].get("volumeMounts", []):
            source = volumes.get(mount["name"], {}).get("persistentVolumeClaim")
            if source is None or mount["mountPath"] == "/workspace" or mount.get("subPath"):
                continue
            if mount["mountPath"] != api.CACHE_DIR:
                raise errors.NotBuiltYet(f"the emulated kubelet mounts claims only at {api.CACHE_DIR}")
            _, claim = self._find("persistentvolumeclaims", pod["metadata"]["namespace"], source["claimName"])
            if claim is None or claim.deleted:
                return None, f'persistentvolumeclaim "{source["claimName"]}" not found'
            key = ids.token(source["claimName"])
        return key, None

    async def _run_pod(self, pod: dict[str, Any]) -> None:
        meta, container = pod["metadata"], pod["spec"]["containers"][0]
        if container["image"] not in self.images:
            message = f'Failed to pull image "{container["image"]}": not found'
            await self.write(
                "pods",
                meta["namespace"],
                meta["name"],
                {
                    "status": {
                        "containerStatuses": [
                            {
                                "name": container["name"],
                                "ready": False,
                                "restartCount": 0,
                                "image": container["image"],
                                "imageID": "",
                                "state": {"waiting": {"reason": "ErrImagePull", "message": message}},
                            }
                        ]
                    }
                },
            )
            return
        claim = self._claim_of(pod)
        if claim is None:  # not a sandbox (a proxy pod): reported running, nothing runs
            await self._mark_running(pod)
            return
        cache, unschedulable = self._shared_claims(pod)
        if unschedulable is not None:  # as the scheduler does: Pending until the claim exists
            condition = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
            await self.write(
                "pods", meta["namespace"], meta["name"],
                {"status": {"phase": "Pending", "conditions": [{**condition, "message": unschedulable}]}},
            )  # fmt: skip
            return
        security = {**pod["spec"].get("securityContext", {}), **container.get("securityContext", {})}
        limits = container.get("resources", {}).get("limits", {})
        spec = api.SandboxSpec(
            sandbox_id=claim,
            run_as_root=security.get("runAsUser", 0) == 0,
            writable_root=not security.get("readOnlyRootFilesystem", False),
            limits=api.Limits(
                memory_bytes=_bytes(limits.get("memory", "2Gi")), cpus=_cpus(limits.get("cpu", "1"))
            ),
            cache=cache,
        )
        made = False
        with contextlib.suppress(errors.Conflict):
            made = (await self._runtime.create(spec)).status == "created"
        if made and (why := await self._provision_from_snapshot(meta["namespace"], claim)) is not None:
            condition = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
            await self._runtime.delete(claim)  # (not provisioned: made again on the next try)
            await self.write(
                "pods", meta["namespace"], meta["name"],
                {"status": {"phase": "Pending", "conditions": [{**condition, "message": why}]}},
            )  # fmt: skip
            return
        await self._runtime.start(spec.sandbox_id)
        await self._mount_volumes(pod, spec.sandbox_id)
        await self._mark_running(pod)

    # ---- the CSI snapshot controller and provisioner ---------------------------------------

    def _volume_snapshot_dir(self, namespace: str, name: str) -> Any:
        return self.state_dir / "volumesnapshots" / namespace / name

    async def _take_volume_snapshot(self, snapshot: dict[str, Any]) -> None:
        """As the CSI snapshotter does: a copy of what the source claim's volume holds (its
        ``workspace`` and ``control`` sub-paths: the local sandbox's directories), then
        ``readyToUse`` with its ``restoreSize`` and bound content's name."""
        meta = snapshot["metadata"]
        source = snapshot.get("spec", {}).get("source", {}).get("persistentVolumeClaimName")
        _, claim = self._find("persistentvolumeclaims", meta["namespace"], source or "")
        if claim is None or claim.deleted:
            error = {"message": f'persistentvolumeclaim "{source}" not found', "time": _now()}
            await self.write(
                "volumesnapshots",
                meta["namespace"],
                meta["name"],
                {"status": {"readyToUse": False, "error": error}},
            )
            return
        target = self._volume_snapshot_dir(meta["namespace"], meta["name"])
        size = await asyncio.to_thread(self._copy_volume, self._volume_of(source), target)
        status = {
            "readyToUse": True,
            "restoreSize": str(max(size, 1)),
            "boundVolumeSnapshotContentName": f"snapcontent-{meta['uid']}",
            "creationTime": _now(),
        }
        await self.write("volumesnapshots", meta["namespace"], meta["name"], {"status": status})

    def _volume_of(self, claim: str) -> Any:
        """The local directory standing for a workspace claim's volume (its local sandbox's)."""
        from shared.runtime.local import disk

        d = self._runtime.dirs.dir(claim)
        return disk.Disk.root(d) if d.exists() else None

    @staticmethod
    def _copy_volume(volume: Any, target: Any) -> int:
        import shutil
        import subprocess

        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        size = 0
        for sub in ("workspace", "control"):
            if volume is not None and (volume / sub).is_dir():
                subprocess.run(["cp", "-a", "--", str(volume / sub), str(target / sub)], check=True)
                size += sum(
                    p.stat().st_size for p in (target / sub).rglob("*") if p.is_file() and not p.is_symlink()
                )
            else:
                (target / sub).mkdir()
        return size

    async def _provision_from_snapshot(self, namespace: str, claim_name: str) -> str | None:
        """A new volume for a claim with a VolumeSnapshot ``dataSource`` holds the snapshot's
        content (what the CSI provisioner does); why it cannot be provisioned, or None."""
        _, claim = self._find("persistentvolumeclaims", namespace, claim_name)
        source = (claim.raw.get("spec", {}).get("dataSource") or {}) if claim is not None else {}
        if source.get("kind") != "VolumeSnapshot":
            return None
        _, snapshot = self._find("volumesnapshots", namespace, source.get("name", ""))
        if snapshot is None or snapshot.deleted or not (snapshot.raw.get("status") or {}).get("readyToUse"):
            return f'volumesnapshot "{source.get("name")}" not found or not ready'
        content = self._volume_snapshot_dir(namespace, source["name"])
        volume = self._volume_of(claim_name)

        def restore() -> None:
            import shutil
            import subprocess

            for sub in ("workspace", "control"):
                shutil.rmtree(volume / sub, ignore_errors=True)
                subprocess.run(["cp", "-a", "--", str(content / sub), str(volume / sub)], check=True)

        await asyncio.to_thread(restore)
        return None

    async def _mount_volumes(self, pod: dict[str, Any], sandbox_id: str) -> None:
        """emptyDir volumes: a world-writable directory; configMap volumes: their files.
        Both made inside the sandbox as its user, so only where it may write them (root
        sandboxes with a writable root; /tmp is the sandbox's own tmpfs anyway)."""
        container = pod["spec"]["containers"][0]
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        for mount in container.get("volumeMounts", []):
            volume = volumes.get(mount["name"], {})
            if "emptyDir" in volume and mount["mountPath"] != "/tmp":
                await self._runtime.run(
                    sandbox_id, ["sh", "-c", 'mkdir -p "$1" && chmod 777 "$1"', "sh", mount["mountPath"]]
                )
            source = volume.get("configMap")
            if source is None:
                continue
            _, stored = self._find("configmaps", pod["metadata"]["namespace"], source["name"])
            if stored is None:
                if source.get("optional"):
                    continue
                raise errors.NotFound(f'configmap "{source["name"]}" not found')
            for key, text in (stored.raw.get("data") or {}).items():
                path = f"{mount['mountPath']}/{key}"
                result, _, err = await self._runtime.run(
                    sandbox_id,
                    ["sh", "-c", 'mkdir -p "${1%/*}" && cat > "$1"', "sh", path],
                    stdin=text.encode(),
                )
                if result.exit_code != 0:
                    raise errors.InfrastructureError(f"mounting {path}: {err.decode(errors='replace')}")

    async def _mark_running(self, pod: dict[str, Any]) -> None:
        meta, container = pod["metadata"], pod["spec"]["containers"][0]
        now = _now()
        await self.write(
            "pods",
            meta["namespace"],
            meta["name"],
            {
                "status": {
                    "phase": "Running",
                    "podIP": f"10.244.0.{10 + self._rv % 240}",
                    "startTime": now,
                    "conditions": [
                        {"type": "Ready", "status": "True"},
                        {"type": "PodScheduled", "status": "True"},
                    ],
                    "containerStatuses": [
                        {
                            "name": container["name"],
                            "ready": True,
                            "started": True,
                            "restartCount": 0,
                            "image": container["image"],
                            "imageID": container["image"],
                            "state": {"running": {"startedAt": now}},
                        }
                    ],
                }
            },
        )

    async def _kill_pod(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        if (claim := self._claim_of(pod)) is not None:
            with contextlib.suppress(errors.NotFound):
                await self._runtime.stop(claim)
        await self.remove_finalizer("pods", meta["namespace"], meta["name"], KUBELET_FINALIZER)

    def _dependents(self, owner_uid: str, namespace: str) -> list[tuple[Any, Any]]:
        return [
            (key, obj) for key, obj in list(self._objects.items())
            if not obj.deleted and key[1] == namespace
            and any(o.get("uid") == owner_uid for o in obj.raw.get("metadata", {}).get("ownerReferences", []))
        ]  # fmt: skip

    async def _collect(self, resource: Any, key: Any, obj: Any) -> None:
        """Delete one dependent as the garbage collector does (pods gracefully)."""
        if obj.raw["metadata"].get("deletionTimestamp"):
            return
        if resource.plural == "pods":
            await self.write("pods", key[1], key[2], {"metadata": {"deletionTimestamp": _now()}})
        else:
            async with self._lock:
                obj.delete()
                self._record(resource, {"type": "DELETED", "object": obj.last.raw})

    async def _collect_claim(self, claim: dict[str, Any]) -> None:
        """A claim being deleted. Foreground: its dependents go first, then the finalizer.
        Background: they go only once the claim itself is gone (see _react on DELETED).
        pvc-protection holds the claim while any pod uses it, either way."""
        meta = claim["metadata"]
        if FOREGROUND in (meta.get("finalizers") or []):
            for key, obj in self._dependents(meta["uid"], meta["namespace"]):
                await self._collect(key[0], key, obj)
            while self._dependents(meta["uid"], meta["namespace"]):
                await asyncio.sleep(0.02)
            await self.remove_finalizer("persistentvolumeclaims", meta["namespace"], meta["name"], FOREGROUND)
        while any(
            key[0].plural == "pods" and not obj.deleted and key[1] == meta["namespace"]
            and self._claim_of(obj.raw) == meta["name"]
            for key, obj in list(self._objects.items())
        ):  # fmt: skip
            await asyncio.sleep(0.02)
        with contextlib.suppress(errors.NotFound):
            await self._runtime.delete(meta["name"])
        await self.remove_finalizer("persistentvolumeclaims", meta["namespace"], meta["name"], PVC_PROTECTION)

    async def insert(self, resource: Any, body: dict[str, Any]) -> None:
        """Create an object as a controller would (stamped, with its ADDED event)."""
        async with self._lock:
            meta = body.setdefault("metadata", {})
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), resourceVersion=str(self._rv + 1))
            if resource.plural == "pods":
                meta["finalizers"] = [*meta.get("finalizers", []), KUBELET_FINALIZER]
                body["status"] = {"phase": "Pending"}
            self._objects[resource, meta["namespace"], meta["name"]] = body
            self._record(resource, {"type": "ADDED", "object": body})

    async def _reconcile_deployment(self, namespace: str, name: str) -> None:
        """The Deployment controller, reduced to replicas: pods from the template up to
        ``spec.replicas``; the newest go first on scale-down (gracefully, as any pod)."""
        _, stored = self._find("deployments", namespace, name)
        if stored is None:
            return
        deployment = stored.raw
        want = int(deployment["spec"].get("replicas", 1))
        selector = deployment["spec"]["selector"]["matchLabels"]

        def owned(key: Any, obj: Any) -> bool:
            meta = obj.raw["metadata"] if not obj.deleted else {}
            labels = meta.get("labels", {})
            return (
                key[0].plural == "pods" and key[1] == namespace and bool(meta)
                and not meta.get("deletionTimestamp") and all(labels.get(k) == v for k, v in selector.items())
            )  # fmt: skip

        pods = sorted(
            (o.raw for k, o in self._objects.items() if owned(k, o)),
            key=lambda p: p["metadata"]["creationTimestamp"],
        )
        pod_resource = kmock.resource("", "v1", "pods")
        for _ in range(want - len(pods)):
            template = copy.deepcopy(deployment["spec"]["template"])
            body = {"apiVersion": "v1", "kind": "Pod", "spec": template["spec"], "metadata": {
                "name": f"{name}-{uuid.uuid4().hex[:5]}", "namespace": namespace,
                "labels": template["metadata"].get("labels", {}),
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": name,
                                     "uid": deployment["metadata"]["uid"]}]}}  # fmt: skip
            await self.insert(pod_resource, body)
        for pod in pods[want:][::-1] if len(pods) > want else []:
            await self.write(
                "pods", namespace, pod["metadata"]["name"], {"metadata": {"deletionTimestamp": _now()}}
            )
        await self.write("deployments", namespace, name, {"status": {"replicas": want}}, quiet=True)

    async def _serve_fetch(self, request: rendering.Request) -> rendering.Payload:
        found = await super()._serve_fetch(request)
        return self._scale_view(found) if request.subresource == "scale" else found

    async def _serve_update(self, request: rendering.Request) -> rendering.Payload:
        found = await super()._serve_update(request)
        return self._scale_view(found) if request.subresource == "scale" else found

    @staticmethod
    def _scale_view(deployment: dict[str, Any]) -> dict[str, Any]:
        """The scale subresource of a Deployment (a PATCH to it merges ``spec.replicas``
        into the Deployment, which is what a real server does)."""
        replicas = int(deployment["spec"].get("replicas", 1))
        labels = deployment["spec"]["selector"]["matchLabels"]
        return {
            "apiVersion": "autoscaling/v1", "kind": "Scale",
            "metadata": {k: deployment["metadata"][k] for k in ("name", "namespace", "uid")},
            "spec": {"replicas": replicas},
            "status": {"replicas": int(deployment.get("status", {}).get("replicas", 0)),
                       "selector": ",".join(f"{k}={v}" for k, v in labels.items())},
        }  # fmt: skip

    # ---- pods/exec -----------------------------------------------------------------------

    async def _exec(
        self, raw: aiohttp.web.BaseRequest, namespace: str, name: str
    ) -> aiohttp.web.StreamResponse:
        _, stored = self._find("pods", namespace, name)
        pod = stored.raw if stored is not None else None
        if pod is None:
            return _status(404, "NotFound", f'pods "{name}" not found')
        if pod.get("status", {}).get("phase") != "Running" or pod["metadata"].get("deletionTimestamp"):
            return _status(400, "BadRequest", "container is not running")
        argv = raw.query.getall("command", [])
        wants_stdin = raw.query.get("stdin") in ("true", "True", "1")
        ws = aiohttp.web.WebSocketResponse(protocols=self.protocols)
        await ws.prepare(raw)
        if ws.ws_protocol is None:
            await ws.close(code=aiohttp.WSCloseCode.PROTOCOL_ERROR, message=b"no supported channel protocol")
            return ws
        v5 = ws.ws_protocol.startswith("v5.")
        container = pod["spec"]["containers"][0]
        env = {e["name"]: e["value"] for e in container.get("env", [])}
        for channel in (1, 2):
            await ws.send_bytes(bytes([channel]))
        try:
            proc = await self._runtime.exec(
                self._claim_of(pod),
                argv,
                env=env,
                cwd=container.get("workingDir"),
                keep_stdin_open=wants_stdin,
            )
        except errors.SandboxError as exc:
            await ws.send_bytes(b"\x03" + json.dumps({"status": "Failure", "message": str(exc)}).encode())
            await ws.close()
            return ws

        async def pump_out() -> None:
            async for stream, data in proc.chunks():
                await ws.send_bytes(bytes([1 if stream == "stdout" else 2]) + data)

        async def pump_in() -> None:
            async for message in ws:
                if message.type != aiohttp.WSMsgType.BINARY or not message.data:
                    continue
                channel, payload = message.data[0], message.data[1:]
                with contextlib.suppress(errors.SandboxError):
                    if channel == 0 and wants_stdin and payload:
                        await proc.send(payload)
                    elif channel == 255 and v5 and payload[:1] == b"\x00":
                        await proc.close_stdin()
            with contextlib.suppress(errors.SandboxError, OSError):
                await proc.close_stdin()  # the client hung up: its stdin is gone, the command is not

        reading = asyncio.create_task(pump_in())
        with contextlib.suppress(ConnectionError, RuntimeError):
            await pump_out()
        result = await proc.wait()
        status: dict[str, Any] = {"metadata": {}, "status": "Success"}
        if result.exit_code != 0:
            status = {
                "metadata": {},
                "status": "Failure",
                "reason": "NonZeroExitCode",
                "message": f"command terminated with non-zero exit code: exit status {result.exit_code}",
                "details": {"causes": [{"reason": "ExitCode", "message": str(result.exit_code)}]},
            }
        with contextlib.suppress(ConnectionError, RuntimeError):
            await ws.send_bytes(b"\x03" + json.dumps(status).encode())
        await ws.close()
        reading.cancel()
        return ws


def _status(code: int, reason: str, message: str) -> aiohttp.web.Response:
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    }
    return aiohttp.web.json_response(body, status=code)


def _bytes(quantity: str) -> int:
    units = {"Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "k": 1000, "M": 1000**2, "G": 1000**3}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return int(float(quantity[: -len(suffix)]) * factor)
    return int(quantity)


def _cpus(quantity: str) -> float:
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)
