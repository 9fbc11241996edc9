"""An agent over MCP asks for images from a registry (a real docker-registry on loopback)
under a real `sbx up`: a pool of one image is filled after its pull and a session asking
for it claims warm; a shell-only image works; a missing image is a clear error. The pulls
are in the event stream."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.parse

import httpx2
import pytest
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client

from shared.runtime.local import registry
from tests import oci_registry as o
from tests import support
from tests.e2e.agent import Agent
from tests.e2e.stacks import running_stack

pytestmark = [pytest.mark.needs_root("the local runtime needs root"), pytest.mark.slow]


def events(state) -> list[dict]:
    listed = subprocess.run(
        [sys.executable, "-m", "sbx.cli", "events", "--json", "--state-dir", str(state)],
        capture_output=True, text=True, timeout=60, cwd=support.ROOT,
    ).stdout  # fmt: skip
    return [json.loads(line)["event"] for line in listed.splitlines() if line.startswith("{")]


@pytest.fixture
def registry_stack(tmp_path):
    """A registry with two images, and `sbx up` with a warm pool of the first one."""
    if missing := o.missing_tools():
        pytest.fail(f"missing {', '.join(missing)}: scripts/setup --dev installs them")
    reg = o.Registry(tmp_path / "registry").start()
    try:
        bashy, shonly = tmp_path / "bashy", tmp_path / "shonly"
        o.simple_image(
            bashy, o.host_bash_layer(), o.layer({"etc/marker": b"bashy\n"}), config={"Env": ["TOOL=1"]}
        )
        o.simple_image(shonly, o.layer({"etc/marker": b"sh only\n"}))
        reg.push(bashy, "test/bashy:1")
        reg.push(shonly, "test/shonly:1")
        pools = json.dumps([{"name": "bashy", "image": f"{reg.host}/test/bashy:1", "min_idle": 1}])
        state = tmp_path / "state"
        named = o.registries_file(tmp_path / "registries.toml", reg.host)  # the operator's allow-list
        with running_stack(state, SBX_POOLS=pools, SBX_POOL_MIN_IDLE="0", SBX_REGISTRIES_FILE=str(named)) as (
            _,
            url,
        ):
            yield reg, state, url
    finally:
        reg.stop()


async def test_an_agent_gets_registry_images_and_a_pool_of_one_starts_warm(registry_stack):
    reg, state, url = registry_stack
    pooled = f"{reg.host}/test/bashy:1"
    key = (state / "api-key").read_text().strip()

    def pool_ready() -> bool:
        return any(e["type"] == "sandbox.started" and e.get("image_digest") for e in events(state))

    await support.eventually(pool_ready, timeout=60, interval=0.5)  # pulled, then filled
    agent = Agent(url, key, "reg-1")
    ok, text = await agent.call("create_sandbox", image=pooled)
    assert ok, text
    ok, text = await agent.call("shell", command='cat /etc/marker; echo "$TOOL"; f() { echo fn; }; x=41')
    assert ok and text.startswith("bashy\n1\n"), text
    ok, text = await agent.call("shell", command="f; echo $((x + 1)); echo ${BASH_VERSION%%.*}")
    assert ok and text.startswith("fn\n42\n5"), text  # one live bash session

    other = Agent(url, key, "reg-2")
    ok, text = await other.call("create_sandbox", image=f"{reg.host}/test/shonly:1")
    assert ok, text
    ok, text = await other.call("shell", command="cd /etc && export A=1; cat marker")
    assert ok and text.startswith("sh only"), text
    ok, text = await other.call("shell", command='pwd; echo "$A"')
    assert ok and text.startswith("/etc\n1\n"), text

    ok, text = await Agent(url, key, "reg-3").call("create_sandbox", image=f"{reg.host}/test/missing:1")
    assert not ok and "has no image" in text and "test/missing:1" in text, text

    # The host's own services are no registry: the gateway's port, a closed one, metadata.
    gateway = urllib.parse.urlparse(url).port
    said = []
    hosts = (f"127.0.0.1:{gateway}", f"127.0.0.1:{support.free_port()}", "169.254.169.254")
    for host in hosts:
        ok, text = await Agent(url, key, "reg-4").call("create_sandbox", image=f"{host}/x/y:1")
        assert not ok and registry.UNREACHABLE.format(host=host) in text, text
        said.append(text.replace(host, "HOST"))
    assert len(set(said)) == 1, said  # one text: nothing tells what listens

    seen = events(state)
    pulls = [e for e in seen if e["type"].startswith("image.")]
    pulled = {e["reference"]: e for e in pulls if e["type"] == "image.pulled"}
    assert set(pulled) == {pooled, f"{reg.host}/test/shonly:1"}
    assert all(p["digest"].startswith("sha256:") and p["size"] > 0 for p in pulled.values())
    failed = [e for e in pulls if e["type"] == "image.pull_failed"]
    assert [f["reference"] for f in failed] == [f"{reg.host}/test/missing:1", *(f"{h}/x/y:1" for h in hosts)]
    claimed = [e for e in seen if e["type"] == "sandbox.claimed" and e.get("session_id") == "reg-1"]
    assert claimed, "the session for the pool's image claimed a warm sandbox"
    assert sum(1 for e in pulls if e["type"] == "image.pull_started" and e["reference"] == pooled) == 1


@pytest.fixture
def slow_registry(tmp_path):
    """A registry with one image (the front that slows it down, and the stack that names the
    front as an operator's registry, are the test's: the front runs on its event loop)."""
    if missing := o.missing_tools():
        pytest.fail(f"missing {', '.join(missing)}: scripts/setup --dev installs them")
    reg = o.Registry(tmp_path / "registry").start()
    try:
        layout = tmp_path / "slow"
        o.simple_image(layout, o.layer({"etc/marker": b"slow pull\n"}))
        reg.push(layout, "test/slow:1")
        yield reg, tmp_path
    finally:
        reg.stop()


async def test_create_sandbox_waits_out_a_pull_slower_than_the_request_timeout(slow_registry):
    """A registry that takes longer to send a blob than the gateway's request timeout (5 s):
    `create_sandbox` waits for the pull, saying how long it has waited (MCP progress), and
    answers with the new sandbox, which runs the image (it answered "the scheduler did not
    answer in time" while the pull went on)."""
    reg, tmp_path = slow_registry
    state = tmp_path / "state"
    blobs = 0

    def slow_first_blob(request_line: bytes) -> float:
        nonlocal blobs
        if b"/blobs/" not in request_line:
            return 0.0
        blobs += 1
        return 8.0 if blobs == 1 else 0.0  # (more than SBX_REQUEST_TIMEOUT's 5 s)

    heard: list[str] = []

    async def progress(done: float, total: float | None, message: str | None) -> None:
        heard.append(message or "")

    async with support.http_front(reg.host, delay=slow_first_blob) as front:
        host = front.removeprefix("http://")
        image = f"{host}/test/slow:1"
        allowed = o.registries_file(tmp_path / "registries.toml", host)  # (a loopback registry: named)
        # (started and stopped in a thread: its clean-up runs an event loop of its own)
        stack = running_stack(state, SBX_POOL_MIN_IDLE="0", SBX_REGISTRIES_FILE=str(allowed))
        _, url = await asyncio.to_thread(stack.__enter__)
        try:
            key = (state / "api-key").read_text().strip()
            headers = {"Authorization": f"Bearer {key}", "X-Session-Id": "slow-1"}
            async with httpx2.AsyncClient(headers=headers, timeout=120) as http:
                async with streamable_http_client(f"{url}/mcp", http_client=http) as (read, write):
                    async with ClientSession(read, write) as mcp:
                        await mcp.initialize()
                        asked = {"image": image}
                        result = await mcp.call_tool("create_sandbox", asked, progress_callback=progress)
            text = "".join(getattr(c, "text", "") for c in result.content)
            assert not result.is_error, text
            assert "provisioned" in text and image in text
            assert blobs >= 1, "the pull went through the slow front"
            assert heard and all(m.startswith("starting the new sandbox: ") for m in heard), heard
            ok, text = await Agent(url, key, "slow-1").call("shell", command="cat /etc/marker")
            assert ok and text.startswith("slow pull"), text
            pulls = [e["type"] for e in events(state) if e.get("reference") == image]
            assert pulls == ["image.pull_started", "image.pulled"]
        finally:
            await asyncio.to_thread(stack.__exit__, None, None, None)
