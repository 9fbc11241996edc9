"""Snapshots, forks and restores as an operator and an agent see them: a real `sbx up`, real
sandboxes, the official MCP client, the REST API and the CLI.

An agent's files (``/workspace``, a file written in the copy-on-write root) and its shell's
directory and exports are snapshotted while a background writer runs; forks start with
them, each on its own; the origin is restored to the snapshot; deleting the snapshot
leaves its forks whole (a fork stopped and started again after the delete still has its
files); another organisation's snapshot is as unknown as a missing one; every transition
is in the stream and replay agrees."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.e2e.agent import TOOLS, Agent
from tests.e2e.stacks import running_stack, sbx

pytestmark = [
    pytest.mark.needs_root("the local runtime needs root"),
    pytest.mark.slow,
    pytest.mark.timeout(300),
]
WRITER = (  # each file is written whole, then renamed: a copy never sees half of one
    "(i=0; while :; do i=$((i+1)); echo $i > /workspace/.n && mv /workspace/.n /workspace/n; done) "
    ">/dev/null 2>&1 </dev/null &"
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    state = tmp_path_factory.mktemp("snapshots") / "state"
    with running_stack(state) as (_, url):
        yield state, url, (state / "api-key").read_text().strip()


def stream_types(state, *types: str) -> list[dict]:
    out = sbx("events", "--json", state=state)
    assert out.returncode == 0, out.stderr
    return [e for e in (json.loads(line)["event"] for line in out.stdout.splitlines()) if e["type"] in types]


async def test_snapshot_fork_restore_and_delete_over_rest(stack):
    state, url, key = stack
    auth = {"Authorization": f"Bearer {key}"}
    origin = Agent(url, key, "origin", **{"X-Org-Id": "acme"})
    ok, text = await origin.call(
        "shell",
        command=(
            "echo v1 > /workspace/f; echo doomed > /workspace/gone; mkdir -p /usr/local/share/sbx && "
            f"echo installed > /usr/local/share/sbx/marker; export MODE=one; cd /tmp; {WRITER} echo ready"
        ),
    )
    assert ok and "ready" in text, text
    ok, text = await origin.call("shell", command="rm /workspace/gone; echo removed")
    assert ok, text
    async with httpx.AsyncClient(base_url=url, headers=auth, timeout=120) as rest:
        made = await rest.post(
            "/v1/sessions/origin/snapshots", headers={"Idempotency-Key": "snap-1", "X-Org-Id": "acme"}
        )
        assert made.status_code == 201, made.text
        snap = made.json()
        assert snap["status"] == "ready" and snap["session_id"] == "origin" and snap["org_id"] == "acme"
        assert snap["digest"].startswith("sha256:") and snap["size"] > 0 and snap["layers"] == 1
        assert made.headers["location"] == f"/v1/snapshots/{snap['snapshot_id']}"
        again = await rest.post(
            "/v1/sessions/origin/snapshots", headers={"Idempotency-Key": "snap-1", "X-Org-Id": "acme"}
        )
        assert again.status_code == 201 and again.json() == snap  # the same request again: the same one
        assert (await rest.get(f"/v1/snapshots/{snap['snapshot_id']}")).json() == snap
        listed = (await rest.get("/v1/snapshots", params={"session_id": "origin"})).json()
        assert listed["count"] == 1 and listed["snapshots"] == [snap]

        # The origin goes on; the snapshot keeps what was.
        ok, text = await origin.call("shell", command="echo v2 > /workspace/f; echo changed")
        assert ok, text

        forked = await rest.post(
            f"/v1/snapshots/{snap['snapshot_id']}/forks", json={"count": 3}, headers={"X-Org-Id": "acme"}
        )
        assert forked.status_code == 201, forked.text
        sessions = forked.json()["sessions"]
        assert len(sessions) == 3 and forked.json()["failed"] == []
        assert all(s["forked_from"] == snap["snapshot_id"] and s["org_id"] == "acme" for s in sessions)
        forks = [Agent(url, key, s["session_id"], **{"X-Org-Id": "acme"}) for s in sessions]
        seen = await asyncio.gather(
            *(
                f.call(
                    "shell",
                    command=(
                        "cat /workspace/f /usr/local/share/sbx/marker; "
                        'ls /workspace/gone 2>&1 | head -1; echo "$MODE $PWD"; cat /workspace/n'
                    ),
                )
                for f in forks
            )
        )
        for ok, text in seen:
            lines = text.splitlines()
            assert ok and lines[:2] == ["v1", "installed"], text
            assert "No such file" in lines[2] and lines[3] == "one /tmp", text
            assert lines[4].isdigit(), f"the writer's file is whole in the fork: {text}"

        # Forks are isolated from each other and from the origin.
        ok, _ = await forks[0].call("shell", command="echo mine > /workspace/only-0; echo v3 > /workspace/f")
        assert ok
        ok, text = await forks[1].call("shell", command="ls /workspace; cat /workspace/f")
        assert ok and "only-0" not in text and text.splitlines()[-2] == "v1", text
        ok, text = await origin.call("shell", command="ls /workspace; cat /workspace/f")
        assert ok and "only-0" not in text and "v2" in text, text

        # Restore: the origin's files go back to the snapshot (a new sandbox; a new shell).
        restored = await rest.post(
            "/v1/sessions/origin/restore",
            json={"snapshot_id": snap["snapshot_id"]},
            headers={"X-Org-Id": "acme"},
        )
        assert restored.status_code == 200, restored.text
        ok, text = await origin.call("shell", command="cat /workspace/f; pwd")
        assert ok and text.splitlines()[:2] == ["v1", "/tmp"], text

        # Another organisation's snapshot is unknown to it; a fork of a taken id is refused.
        other = {"X-Org-Id": "globex"}
        refused = await rest.post(
            f"/v1/snapshots/{snap['snapshot_id']}/forks", json={"count": 1}, headers=other
        )
        assert refused.status_code == 404, refused.text
        taken = await rest.post(
            f"/v1/snapshots/{snap['snapshot_id']}/forks",
            json={"session_ids": ["origin"]},
            headers={"X-Org-Id": "acme"},
        )
        assert taken.status_code == 409, taken.text
        bad = await rest.post(f"/v1/snapshots/{snap['snapshot_id']}/forks", json={"count": 0})
        assert bad.status_code == 400, bad.text
        assert (await rest.post("/v1/sessions/ghost/snapshots")).status_code == 404
        await rest.post("/v1/sessions", json={"session_id": "unused"})
        assert (await rest.post("/v1/sessions/unused/snapshots")).status_code == 409  # no sandbox yet

        # Deleting the snapshot never breaks a fork: stopped and started again, it has its files.
        assert (await rest.delete(f"/v1/snapshots/{snap['snapshot_id']}")).status_code == 204
        assert (await rest.delete(f"/v1/snapshots/{snap['snapshot_id']}")).status_code == 204  # idempotent
        assert (await rest.get(f"/v1/snapshots/{snap['snapshot_id']}")).status_code == 404
        gone = (await rest.get("/v1/snapshots", params={"status": "deleted"})).json()["snapshots"]
        assert [(g["snapshot_id"], g["delete_reason"]) for g in gone] == [(snap["snapshot_id"], "requested")]
        assert (await rest.post(f"/v1/sessions/{sessions[1]['session_id']}/stop")).status_code == 200
        ok, text = await forks[1].call("shell", command="cat /workspace/f /usr/local/share/sbx/marker")
        lines = [line for line in text.splitlines() if not line.startswith("[a new shell:")]  # (restarted)
        assert ok and lines[:2] == ["v1", "installed"], text
        late = await rest.post(f"/v1/snapshots/{snap['snapshot_id']}/forks", json={"count": 1})
        assert late.status_code == 404, late.text

        # The origin's timeline says when it was snapshotted, restored, and the snapshot deleted;
        # a fork's says what it was forked from.
        timeline = (await rest.get("/v1/sessions/origin/timeline", params={"kind": "lifecycle"})).json()
        types = [e["type"] for e in timeline["entries"]]
        assert "snapshot.created" in types and "snapshot.deleted" in types, types
        assert types.index("snapshot.created") < types.index("session.sandbox_released"), types
        fork_line = (await rest.get(f"/v1/sessions/{sessions[0]['session_id']}/timeline")).json()
        assert any(f"forked_from={snap['snapshot_id']}" in e["summary"] for e in fork_line["entries"])

    created = stream_types(state, "snapshot.created", "snapshot.deleted")
    assert [e["type"] for e in created] == ["snapshot.created", "snapshot.deleted"]
    assert created[0]["meta"]["org_id"] == "acme" and created[0]["frozen_ms"] >= 0
    requested = [e for e in stream_types(state, "sandbox.requested") if e.get("snapshot")]
    assert len(requested) == 4  # three forks and one restore
    verified = sbx("replay", "--verify", state=state)
    assert verified.returncode == 0, verified.stdout + verified.stderr


async def _warm_ready(rest: httpx.AsyncClient, snapshot_id: str, count: int) -> dict:
    """The snapshot once ``count`` of its idle sandboxes are ready (the pool-manager's refill)."""
    for _ in range(600):
        snap = (await rest.get(f"/v1/snapshots/{snapshot_id}")).json()
        if snap["warm_ready"] == count:
            return snap
        await asyncio.sleep(0.1)
    raise AssertionError(f"{snapshot_id}: warm_ready stayed {snap['warm_ready']}, not {count}")


async def test_a_snapshot_kept_warm_serves_forks_and_restores_from_started_sandboxes(stack):
    """``PUT /v1/snapshots/{id}/warm``: the pool-manager keeps that many idle sandboxes
    started from the snapshot; forks and a restore claim them (``sandbox.claimed``, no new
    ``sandbox.requested`` for the session), they have the snapshot's files and are isolated
    from each other; the pool refills; setting 0 or deleting the snapshot removes the idle
    ones; bad counts and another organisation are refused and change nothing."""
    state, url, key = stack
    auth = {"Authorization": f"Bearer {key}"}
    acme = {"X-Org-Id": "acme"}
    origin = Agent(url, key, "warm-origin", **acme)
    ok, text = await origin.call(
        "shell", command="echo warm > /workspace/w; export KEPT=yes; cd /opt; echo ok"
    )
    assert ok, text
    async with httpx.AsyncClient(base_url=url, headers=auth, timeout=120) as rest:
        snap = (await rest.post("/v1/sessions/warm-origin/snapshots", headers=acme)).json()
        sid = snap["snapshot_id"]
        assert snap["warm"] == 0 and snap["warm_ready"] == 0
        for body, status in (({"count": 101}, 400), ({"count": 1.5}, 400), ({"count": -1}, 400), ({}, 400),
                             ({"count": 1, "more": 1}, 400)):  # fmt: skip
            refused = await rest.put(f"/v1/snapshots/{sid}/warm", json=body, headers=acme)
            assert refused.status_code == status, (body, refused.text)
        other = await rest.put(f"/v1/snapshots/{sid}/warm", json={"count": 2}, headers={"X-Org-Id": "globex"})
        assert other.status_code == 404, other.text
        assert (await rest.put("/v1/snapshots/nope/warm", json={"count": 2})).status_code == 404
        assert (await rest.get(f"/v1/snapshots/{sid}")).json()["warm"] == 0  # nothing changed

        set_ = await rest.put(f"/v1/snapshots/{sid}/warm", json={"count": 2}, headers=acme)
        assert set_.status_code == 200 and set_.json()["warm"] == 2, set_.text
        await _warm_ready(rest, sid, 2)
        pooled = {
            e["sandbox_id"] for e in stream_types(state, "sandbox.requested") if e.get("snapshot") == sid
        }
        assert len(pooled) == 2 and all(
            e.get("pool") for e in stream_types(state, "sandbox.requested") if e["sandbox_id"] in pooled
        )

        forked = await rest.post(f"/v1/snapshots/{sid}/forks", json={"count": 2}, headers=acme)
        assert forked.status_code == 201, forked.text
        sessions = forked.json()["sessions"]
        claimed = {e["sandbox_id"]: e["session_id"] for e in stream_types(state, "sandbox.claimed")}
        assert {claimed.get(b) for b in pooled} == {s["session_id"] for s in sessions}  # not started
        forks = [Agent(url, key, s["session_id"], **acme) for s in sessions]
        for fork in forks:
            ok, text = await fork.call("shell", command='cat /workspace/w; echo "$KEPT $PWD"')
            assert ok and text.splitlines()[:2] == ["warm", "yes /opt"], text
        ok, _ = await forks[0].call("shell", command="echo mine > /workspace/only-0")
        ok, text = await forks[1].call("shell", command="ls /workspace")
        assert ok and "only-0" not in text, text

        # The pool refills; a restore of the origin claims one too (a sandbox is offered once
        # its shell is started, a moment after it runs: a restore before that starts one).
        await _warm_ready(rest, sid, 2)
        for _ in range(10):
            restored = await rest.post(
                "/v1/sessions/warm-origin/restore", json={"snapshot_id": sid}, headers=acme
            )
            assert restored.status_code == 200, restored.text
            refilled = {
                e["sandbox_id"] for e in stream_types(state, "sandbox.requested") if e.get("snapshot") == sid
            }
            claimed = {e["sandbox_id"]: e["session_id"] for e in stream_types(state, "sandbox.claimed")}
            if "warm-origin" in {claimed.get(b) for b in refilled - pooled}:
                break
            await asyncio.sleep(0.5)
        else:
            raise AssertionError("no restore claimed a sandbox of the snapshot's pool")
        ok, text = await origin.call("shell", command="cat /workspace/w")
        assert ok and text.startswith("warm"), text

        # Fewer, then none: the idle ones are removed; deleting the snapshot drains its pool.
        assert (await rest.put(f"/v1/snapshots/{sid}/warm", json={"count": 0})).json()["warm"] == 0
        await _warm_ready(rest, sid, 0)
        assert (await rest.put(f"/v1/snapshots/{sid}/warm", json={"count": 1})).status_code == 200
        await _warm_ready(rest, sid, 1)
        idle = {e["sandbox_id"] for e in stream_types(state, "sandbox.requested") if e.get("snapshot") == sid}
        idle -= set(claimed)
        assert (await rest.delete(f"/v1/snapshots/{sid}")).status_code == 204
        for _ in range(300):
            deleted = {e["sandbox_id"] for e in stream_types(state, "sandbox.deleted")}
            if idle <= deleted:
                break
            await asyncio.sleep(0.2)
        assert idle <= deleted, idle - deleted
        ok, text = await forks[0].call("shell", command="cat /workspace/w /workspace/only-0")
        assert ok and text.splitlines()[:2] == ["warm", "mine"], text

    counts = [e["count"] for e in stream_types(state, "snapshot.warm_set") if e["snapshot_id"] == sid]
    assert counts == [2, 0, 1], counts
    async with httpx.AsyncClient(base_url=url, headers=auth, timeout=60) as rest:
        timeline = (await rest.get("/v1/sessions/warm-origin/timeline", params={"kind": "lifecycle"})).json()
    said = [e["summary"] for e in timeline["entries"] if e["type"] == "snapshot.warm_set"]
    assert said[0] == f"snapshot.warm_set (snapshot_id={sid}, count=2)", said


async def test_the_cli_takes_lists_forks_restores_and_deletes(stack):
    state, url, key = stack
    agent = Agent(url, key, "cli-origin")
    ok, text = await agent.call("shell", command="echo cli > /workspace/c; echo ok")
    assert ok, text
    out = sbx("snapshot", "create", "cli-origin", "--id", "cli-snap", "--json", state=state)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["snapshot_id"] == "cli-snap"
    listed = sbx("snapshot", "list", "--session", "cli-origin", state=state)
    assert listed.returncode == 0 and "cli-snap" in listed.stdout, listed
    shown = sbx("snapshot", "show", "cli-snap", "--json", state=state)
    assert shown.returncode == 0 and json.loads(shown.stdout)["status"] == "ready"
    forked = sbx("snapshot", "fork", "cli-snap", "--session-id", "cli-fork", state=state)
    assert forked.returncode == 0 and "cli-fork: forked from cli-snap" in forked.stdout, forked
    ok, text = await Agent(url, key, "cli-fork").call("shell", command="cat /workspace/c")
    assert ok and text.startswith("cli"), text
    ok, _ = await agent.call("shell", command="rm /workspace/c")
    restored = sbx("snapshot", "restore", "cli-origin", "cli-snap", state=state)
    assert restored.returncode == 0 and "restored to cli-snap" in restored.stdout, restored
    ok, text = await agent.call("shell", command="cat /workspace/c")
    assert ok and text.startswith("cli"), text
    assert sbx("snapshot", "delete", "cli-snap", state=state).returncode == 0
    # The session's events: its own, its sandboxes', its snapshots' (none of the fork's).
    out = sbx("events", "--json", "--session", "cli-origin", state=state).stdout
    seen = [json.loads(line)["event"] for line in out.splitlines()]
    types = [e["type"] for e in seen]
    assert types.count("snapshot.created") == 1 and types.count("snapshot.deleted") == 1, types
    assert "sandbox.started" in types, types
    assert any(e["type"] == "sandbox.requested" and e.get("snapshot") == "cli-snap" for e in seen)  # restore
    assert all(e.get("session_id") in ("cli-origin", None) for e in seen), seen
    assert not any(e.get("session_id") == "cli-fork" for e in seen)
    assert sbx("snapshot", "show", "nope", state=state).returncode == 1
    assert sbx("snapshot", "fork", "cli-snap", state=state).returncode == 1  # deleted: not forked
    assert sbx("snapshot", "create", "bad id!", state=state).returncode == 2
    assert sbx("snapshot", "warm", "cli-snap", "1", state=state).returncode == 1  # deleted: not kept warm
    assert sbx("snapshot", "warm", "cli-snap", "101", state=state).returncode == 2


def test_an_agent_checkpoints_its_own_session_and_goes_back(tmp_path):
    """With SBX_MCP_CHECKPOINTS=on an agent has two more tools (the eight are unchanged) and
    can go back only to its own checkpoints."""
    state = tmp_path / "state"
    with running_stack(state, SBX_MCP_CHECKPOINTS="on") as (_, url):
        key = (state / "api-key").read_text().strip()
        agent, other = Agent(url, key, "explorer"), Agent(url, key, "bystander")

        async def go() -> None:
            assert await agent.tools() == TOOLS | {"checkpoint", "restore_checkpoint"}
            ok, _ = await agent.call("shell", command="echo good > /workspace/plan; cd /tmp; export TRY=1")
            assert ok
            ok, text = await agent.call("checkpoint")
            assert ok and text.startswith("checkpoint cp-"), text
            checkpoint = text.split()[1]
            ok, _ = await agent.call("shell", command="echo broken > /workspace/plan; export TRY=2")
            ok, text = await other.call("restore_checkpoint", checkpoint_id=checkpoint)
            assert not ok and "does not exist" in text, text  # not its checkpoint
            ok, text = await agent.call("restore_checkpoint", checkpoint_id=checkpoint)
            assert ok and checkpoint in text, text
            ok, text = await agent.call("shell", command='cat /workspace/plan; echo "$TRY $PWD"')
            assert ok and text.splitlines()[:2] == ["good", "1 /tmp"], text
            ok, text = await agent.call("restore_checkpoint", checkpoint_id="../etc")
            assert not ok and "checkpoint id" in text, text

        asyncio.run(go())
