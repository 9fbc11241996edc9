"""Sandbox programs that flood the host, against a real `sbx up` (issue 34, item 5).

The gateway and the executor take bytes from programs in the sandbox (its own ``tar`` and
``find``, which root inside can replace, and any command's output). Each path is attacked
with a program that writes far more than any bound; the gateway's and the executor's peak
memory (``VmHWM``, reset before) must stay flat, the request must end with a clear error
or be stopped, and nothing may keep running; then the sandbox's real tools work again.
"""

from __future__ import annotations

import contextlib
import io
import os
import tarfile
import time
from collections.abc import Iterator

import httpx
import msgspec
import pytest

from sbx_api import hostapi
from tests import support
from tests.e2e.stacks import running_stack, status

pytestmark = [pytest.mark.needs_root("the local runtime needs root"), pytest.mark.slow]
FLAT = 64 * 1024**2
TAR = {"Content-Type": hostapi.TAR_MEDIA_TYPE}
"""How much a service's peak memory may grow while it is flooded."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    state = tmp_path_factory.mktemp("stack")
    with running_stack(state) as (_, url):
        pids = {i["service"]: i["pid"] for i in status(state)["services"]}
        yield url, (state / "api-key").read_text().strip(), (pids["gateway"], pids["executor"])


@pytest.fixture
def client(stack):
    url, key, _ = stack
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as client:
        yield client


@contextlib.contextmanager
def flat_memory(pids: tuple[int, ...]) -> Iterator[None]:
    """Asserts that no process in ``pids`` grew its peak memory by :data:`FLAT` or more."""
    for pid in pids:
        support.reset_peak_memory(pid)
    before = {pid: support.peak_memory(pid) for pid in pids}
    yield
    grown = {pid: support.peak_memory(pid) - before[pid] for pid in pids}
    assert all(g < FLAT for g in grown.values()), {pid: f"{g / 1024**2:.0f} MiB" for pid, g in grown.items()}


def sh(client: httpx.Client, session: str, command: str) -> str:
    """Run ``command`` in the session's sandbox; its stdout (it must succeed)."""
    lines = client.post(f"/v1/sessions/{session}/run", json={"command": command}).text.splitlines()
    events = [msgspec.json.decode(line) for line in lines if line]
    assert events[-1]["type"] == "exit" and events[-1]["exit_code"] == 0, events[-3:]
    return "".join(e["data"] for e in events if e["type"] == "stdout")


def replace_tool(client: httpx.Client, session: str, name: str, body: str) -> None:
    """Put a ``name`` that runs ``body`` first in the sandbox's PATH (root inside can)."""
    sh(
        client,
        session,
        f"printf '#!/bin/sh\\n%s\\n' '{body}' > /usr/local/bin/{name}; chmod +x /usr/local/bin/{name}",
    )


def a_tar(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, data in files.items():
            member = tarfile.TarInfo(name)
            member.size = len(data)
            archive.addfile(member, io.BytesIO(data))
    return buffer.getvalue()


def gone(client: httpx.Client, session: str, program: str) -> bool:
    """Whether no process of ``program`` runs in the sandbox any more."""
    for _ in range(100):
        if sh(client, session, f"pgrep -xc {program} || true").strip() == "0":
            return True
        sh(client, session, "sleep 0.1")
    return False


def frames(answer: httpx.Response) -> Iterator[tuple[bytes, bytes]]:
    reader = hostapi.FrameReader()
    for chunk in answer.iter_bytes():
        yield from reader.feed(chunk)


def test_an_upload_answered_by_a_flooding_tar_is_cut_off(client, stack):
    """The issue's attack: the sandbox's tar answers an archive upload with 400 MB (the
    gateway used to spool it and read it back whole: 111 -> 969 MiB)."""
    session = "flood-put"
    replace_tool(client, session, "tar", "head -c 400000000 /dev/zero")
    upload = a_tar({"a.txt": b"hello\n", "big.bin": os.urandom(2 * 1024**2)})
    with flat_memory(stack[2]):
        answer = client.put(f"/v1/sessions/{session}/archive", content=upload, headers=TAR)
    assert answer.status_code == 429 and answer.json()["error"] == "limit_exceeded", answer.text
    assert "not asked for" in answer.json()["message"] and "killed" in answer.json()["message"]
    assert gone(client, session, "head")
    replace_tool(client, session, "tar", "head -c 400000000 /dev/zero >&2")  # messages: the same bound
    with flat_memory(stack[2]):
        answer = client.put(f"/v1/sessions/{session}/archive", content=upload, headers=TAR)
    assert answer.status_code == 429 and "not asked for" in answer.json()["message"], answer.text
    assert gone(client, session, "head")

    sh(client, session, "rm /usr/local/bin/tar")
    answer = client.put(f"/v1/sessions/{session}/archive", content=upload, headers=TAR)
    assert answer.status_code == 200, answer.text
    assert sh(client, session, "cat /workspace/a.txt") == "hello\n"


def test_an_upload_listing_without_end_streams_and_stops_at_its_bound(client, stack):
    """files/put with a listing: the listing is streamed once the upload is done (nothing
    held on the way) and stops at LISTING_MAX, its writer killed."""
    session = "flood-list"
    replace_tool(client, session, "find", "exec yes")
    params = hostapi.PutParams(root="/workspace/l", listing=True)
    body = hostapi.frame(hostapi.PARAMS, msgspec.json.encode(params)) + hostapi.frame(
        hostapi.TAR, a_tar({"x.txt": b"x\n"})
    )
    listed, last = 0, (b"", b"")
    with flat_memory(stack[2]):
        with client.stream(
            "POST",
            f"/v1/sessions/{session}/files/put",
            content=body,
            headers={"Content-Type": hostapi.MEDIA_TYPE, "Accept": hostapi.MEDIA_TYPE},
        ) as answer:
            assert answer.status_code == 200
            for last in frames(answer):
                if last[0] == hostapi.LISTING:
                    listed += len(last[1])
    assert last[0] == hostapi.ERROR, last
    error = msgspec.json.decode(last[1])
    assert error["error"] == "limit_exceeded" and "listing is larger than" in error["message"]
    assert hostapi.LISTING_MAX - 1024**2 < listed <= hostapi.LISTING_MAX  # streamed up to the bound
    assert gone(client, session, "yes")

    sh(client, session, "rm /usr/local/bin/find")
    with client.stream("POST", f"/v1/sessions/{session}/files/put", content=body) as answer:
        got = list(frames(answer))
    assert got[-1][0] == hostapi.END
    assert "x.txt" in hostapi.parse_listing(
        b"".join(data for channel, data in got if channel == hostapi.LISTING)
    )


def test_output_without_end_waits_for_a_slow_reader_and_stops_with_it(client, stack):
    """A run's output is the command's own: streamed, never held beyond the flow-control
    window, however slowly the client reads; the client going away stops the command."""
    session = "flood-run"
    sh(client, session, "true")
    with flat_memory(stack[2]):
        with client.stream("POST", f"/v1/sessions/{session}/run", json={"command": "yes"}) as answer:
            read = 0
            for line in answer.iter_lines():
                read += len(line)
                if read > 64 * 1024**2:
                    break
            time.sleep(2)  # not reading for a while: nothing may pile up meanwhile
    assert gone(client, session, "yes")


@pytest.mark.parametrize("endpoint", ["archive", "files/get"])
def test_a_download_from_a_tar_without_end_is_streamed_and_stopped(client, stack, endpoint):
    session = "flood-get-" + endpoint.replace("/", "-")
    replace_tool(client, session, "tar", "exec yes")
    with flat_memory(stack[2]):
        if endpoint == "archive":
            request = client.stream("GET", f"/v1/sessions/{session}/archive")
        else:
            request = client.stream(
                "POST", f"/v1/sessions/{session}/files/get", json={"root": "/workspace", "paths": ["a"]}
            )
        with request as answer:
            assert answer.status_code == 200
            read = 0
            for chunk in answer.iter_bytes():
                read += len(chunk)
                if read > 256 * 1024**2:
                    break
    assert gone(client, session, "yes")
    sh(client, session, "rm /usr/local/bin/tar")
    assert client.get(f"/v1/sessions/{session}/archive").status_code == 200
