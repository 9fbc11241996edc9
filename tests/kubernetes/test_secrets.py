"""No secret of the process that runs the Kubernetes runtime reaches a sandbox pod
(security checklist, "Secrets scan", Kubernetes parity).

The API server is emulated (emulator.py: kmock with its gaps filled; there is no
Kubernetes API server here), and its pods run as real local sandboxes. The runtime runs
in a process holding every kind of secret in its environment; the pod specs it writes
and everything visible inside the pods (every ``/proc/*/environ``, ``cmdline``, fd,
mount and file, the scan of tests/e2e/test_secrets.py) must hold none of them.
"""

from __future__ import annotations

import json
import secrets

import pytest
from kubernetes_asyncio import client

from tests.e2e.test_secrets import SCAN
from tests.kubernetes.conftest import SETTINGS, configuration, needs_root
from tests.kubernetes.test_runtime_behaviour import started

pytestmark = [needs_root, pytest.mark.slow]


@pytest.mark.parametrize("root", [True, False], ids=["root", "uid1000"])
async def test_no_secret_reaches_a_pod(cluster, make_kube, monkeypatch, root):
    found = {
        "SANDBOX_API_KEY": "sk-api-" + secrets.token_hex(16),
        "NATS_TOKEN": "nats-" + secrets.token_hex(16),
        "SBX_GITHUB_TOKEN": "ghs_" + secrets.token_hex(16),
        "AWS_SECRET_ACCESS_KEY": "aws-" + secrets.token_hex(16),
    }
    for name, value in found.items():
        monkeypatch.setenv(name, value)
    rt = make_kube()
    sid = await started(rt, run_as_root=root)
    result, out, err = await rt.run(sid, ["sh", "-c", f"export TAG=k8s\n{SCAN}"], timeout=120)
    assert result.exit_code == 0 and b"scanned" in out, err
    result, dump, _ = await rt.run(sid, ["cat", "/workspace/scan-k8s.txt"], timeout=60)
    assert result.exit_code == 0 and b"== /proc/1\n" in dump and len(dump) > 10_000
    text = dump.decode(errors="replace")
    assert [name for name, value in found.items() if value in text] == []

    async with client.ApiClient(configuration(cluster)) as api_client:
        pods = await client.CoreV1Api(api_client).list_namespaced_pod(SETTINGS.namespace)
        written = json.dumps(api_client.sanitize_for_serialization(pods))
    assert pods.items, "the pod spec was not found"
    assert [name for name, value in found.items() if value in written] == []
    await rt.delete(sid)
