"""A session's timeline against a real `sbx up` (issue 21, item 3): lifecycle, commands run
by an MCP agent and over REST, and edits, in order, paged and filtered; followed as NDJSON
and server-sent events, a new command appears while watching; deleted sessions keep
theirs; bad input is refused before anything is read.

Histories belong to their incarnation (issue 34, item 6), with keys bound to organisations
(``SBX_ORG_KEYS``): an id one organisation deleted and another created again shows each
only its own life, on the timeline, the console's session page and its audit page; and
another organisation's snapshot id answers exactly as a missing one."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.agent import Agent
from tests.e2e.stacks import running_stack, support_wait

pytestmark = [pytest.mark.needs_root("the local runtime needs root"), pytest.mark.slow]
ORG_KEYS = {org: f"{org}-timeline-key-{uuid.uuid4().hex}" for org in ("acme", "globex", "initech")}


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("stack")


@pytest.fixture(scope="module")
def stack(state_dir, tmp_path_factory):
    keys = tmp_path_factory.mktemp("org-keys") / "keys"
    keys.write_text("".join(f"{org} {key}\n" for org, key in ORG_KEYS.items()))
    with running_stack(state_dir, SBX_ORG_KEYS=str(keys)) as (_, url):
        yield url, (state_dir / "api-key").read_text().strip()


@pytest.fixture(scope="module")
def orgs(stack):
    """A REST client per organisation-bound key."""
    url, _ = stack
    clients = {
        org: httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120)
        for org, key in ORG_KEYS.items()
    }
    yield clients
    for c in clients.values():
        c.close()


@pytest.fixture
def client(stack):
    url, key = stack
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
        yield client


def page(client: httpx.Client, session: str, **params) -> dict:
    answer = client.get(f"/v1/sessions/{session}/timeline", params=params)
    assert answer.status_code == 200, answer.text
    return answer.json()


async def test_what_an_agent_did_is_on_its_timeline_in_order(stack, client):
    url, key = stack
    agent = Agent(url, key, "tl-1", **{"X-User-Id": "ann", "X-Request-Id": "req-tl-1"})
    ok, _ = await agent.call("shell", command="echo one > a.txt && exit 3")
    assert ok
    ok, _ = await agent.call(
        "str_replace_based_edit_tool", command="create", path="/workspace/notes.md", file_text="héllo\n"
    )
    assert ok
    ok, _ = await agent.call(
        "str_replace_based_edit_tool",
        command="str_replace",
        path="/workspace/notes.md",
        old_str="héllo",
        new_str="",
    )
    assert ok
    ran = client.post("/v1/sessions/tl-1/run", json={"command": "true"})
    assert ran.status_code == 200

    # A run's audit record is appended as its stream ends, so it may land a moment after the
    # answer (CI saw the page without it once): wait for it, then check the page.
    def with_the_run() -> dict | None:
        found = page(client, "tl-1")
        return found if any(e.get("tool") == "run" for e in found["entries"]) else None

    timeline = support_wait(with_the_run, 10)
    entries = timeline["entries"]
    assert [e["seq"] for e in entries] == sorted(e["seq"] for e in entries)
    assert timeline["session_id"] == "tl-1" and not timeline["more"]
    assert timeline["next_after"] == entries[-1]["seq"]
    types = [e["type"] for e in entries]
    assert types.index("session.created") < types.index("session.sandbox_assigned")
    commands = [e for e in entries if e["kind"] == "command"]
    assert [(c["tool"], c["command"], c.get("exit_code")) for c in commands] == [
        ("shell", "echo one > a.txt && exit 3", 3),
        ("run", "true", 0),
    ]
    assert commands[0]["user_id"] == "ann" and commands[0]["request_id"] == "req-tl-1"
    assert commands[0]["sandbox_id"] and commands[0]["duration_ms"] >= 0
    edits = [e for e in entries if e["kind"] == "edit"]
    assert [(e["operation"], e["path"], e["size"]) for e in edits] == [
        ("create", "/workspace/notes.md", len("héllo\n".encode())),
        ("str_replace", "/workspace/notes.md", 0),
    ]
    sandbox_id = commands[0]["sandbox_id"]
    lifecycle = [e for e in entries if e["kind"] == "lifecycle"]
    assert all(e.get("sandbox_id") in (None, sandbox_id) for e in lifecycle)
    # A warm pool sandbox's life before its claim is the pool's, not the session's.
    assert (
        "sandbox.requested" not in types
        or entries[types.index("sandbox.requested")]["seq"] > entries[0]["seq"]
    )

    only = page(client, "tl-1", kind=["edit", "command"])["entries"]
    assert [e["seq"] for e in only] == [e["seq"] for e in entries if e["kind"] in ("edit", "command")]

    # Pages: limit and next_after walk the same entries.
    walked, after = [], 0
    while True:
        got = page(client, "tl-1", limit=2, after=after)
        walked += got["entries"]
        after = got["next_after"]
        if not got["more"]:
            break
    assert walked == entries


def test_a_followed_timeline_shows_new_commands_as_they_run(client):
    assert client.post("/v1/sessions/tl-2/run", json={"command": "echo first"}).status_code == 200
    seen: list[dict] = []
    done = threading.Event()

    def watch(accept: str) -> None:
        with client.stream(
            "GET", "/v1/sessions/tl-2/timeline", params={"follow": "true", "kind": "command"},
            headers={"accept": accept},
        ) as answer:  # fmt: skip
            assert answer.status_code == 200
            assert answer.headers["content-type"].startswith(accept)
            for line in answer.iter_lines():
                if accept == "application/x-ndjson" and line:
                    seen.append(json.loads(line))
                elif line.startswith("data: "):
                    seen.append(json.loads(line[6:]))
                if seen and seen[-1]["command"] == f"echo {accept}":
                    done.set()
                    return

    for accept in ("application/x-ndjson", "text/event-stream"):
        seen.clear()
        done.clear()
        watcher = threading.Thread(target=watch, args=(accept,))
        watcher.start()
        assert client.post("/v1/sessions/tl-2/run", json={"command": f"echo {accept}"}).status_code == 200
        assert done.wait(30), seen
        watcher.join(30)
        assert seen[0]["command"] == "echo first"  # what was there, then what came


def test_a_deleted_session_keeps_its_timeline(client):
    assert client.post("/v1/sessions/tl-3/run", json={"command": "true"}).status_code == 200
    assert client.delete("/v1/sessions/tl-3").status_code == 204
    types = [e["type"] for e in page(client, "tl-3")["entries"]]
    # (the run's audit record is appended as its stream ends: it may land after the delete)
    assert types.index("session.created") < types.index("session.deleted")
    assert "exec.completed" in types


def test_bad_input_is_refused_before_anything_is_read(client):
    assert client.get("/v1/sessions/never-was/timeline").status_code == 404
    for params in ({"kind": "secrets"}, {"limit": 0}, {"limit": 5000}, {"after": -1}, {"follow": "maybe"},
                   {"surprise": 1}):  # fmt: skip
        answer = client.get("/v1/sessions/tl-1/timeline", params=params)
        assert answer.status_code == 400 and answer.json()["error"] == "invalid_input", (params, answer.text)
    assert client.get("/v1/sessions/bad id/timeline").status_code in (400, 404)
    wrong = client.get("/v1/sessions/tl-1/timeline", headers={"accept": "text/event-stream"})
    assert wrong.status_code == 406  # a page is JSON; streams come with follow=true
    assert httpx.get(f"{client.base_url}/v1/sessions/tl-1/timeline").status_code == 401


def sbx(state_dir, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).with_name("sbx")), *args, "--state-dir", str(state_dir)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_sbx_timeline_prints_what_the_route_answers(client, state_dir):
    assert client.post("/v1/sessions/tl-4/run", json={"command": "echo cli"}).status_code == 200
    listed = sbx(state_dir, "timeline", "tl-4", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [json.loads(line) for line in listed.stdout.splitlines()] == page(client, "tl-4")["entries"]
    commands = sbx(state_dir, "timeline", "tl-4", "--kind", "command")
    assert (
        commands.returncode == 0
        and "command" in commands.stdout
        and "run: echo cli -> exit 0" in commands.stdout
    )
    assert len(sbx(state_dir, "timeline", "tl-4", "--json", "--limit", "2").stdout.splitlines()) == 2
    unknown = sbx(state_dir, "timeline", "never-was")
    assert (
        unknown.returncode == 1 and "no such session" in unknown.stderr and "Traceback" not in unknown.stderr
    )
    bad = sbx(state_dir, "timeline", "tl-4", "--kind", "secrets")
    assert bad.returncode == 2 and "kind must be one of" in bad.stderr


def test_sbx_timeline_follows(client, state_dir):
    assert client.post("/v1/sessions/tl-5/run", json={"command": "echo before"}).status_code == 200
    follower = subprocess.Popen(
        [str(Path(sys.executable).with_name("sbx")), "timeline", "tl-5", "-f", "--json", "--kind", "command",
         "--state-dir", str(state_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert json.loads(follower.stdout.readline())["command"] == "echo before"
        assert client.post("/v1/sessions/tl-5/run", json={"command": "echo after"}).status_code == 200
        assert json.loads(follower.stdout.readline())["command"] == "echo after"
    finally:
        follower.send_signal(signal.SIGINT)
        assert follower.wait(30) == 130
    assert "Traceback" not in follower.stderr.read()


# ---- histories belong to their incarnation (issue 34, item 6) ---------------------------


@contextlib.contextmanager
def console_login(url: str, key: str) -> Iterator[httpx.Client]:
    """A console login over plain HTTP (the form, its CSRF token and cookie)."""
    with httpx.Client(base_url=url, timeout=60) as console:
        form = console.get("/console/login")
        csrf = re.search(r'name="csrf" value="([^"]+)"', form.text).group(1)
        done = console.post("/console/login", data={"csrf": csrf, "key": key, "user": "auditor"})
        assert done.status_code == 303 and done.headers["location"] == "/console/sessions", done.text
        yield console


def commands_of(timeline: dict) -> list[str]:
    return [e["command"] for e in timeline["entries"] if e["kind"] == "command"]


def with_command(client: httpx.Client, session: str, command: str) -> dict | None:
    """The timeline once a command's audit record is on it (it may land just after the answer)."""
    found = page(client, session)
    return found if command in commands_of(found) else None


def test_a_re_created_id_shows_each_organisation_only_its_own_life(stack, client, orgs, state_dir):
    url, _ = stack
    acme, globex = orgs["acme"], orgs["globex"]
    sid = "tl-reused"
    assert acme.post("/v1/sessions", json={"session_id": sid}).status_code == 201
    assert acme.post(f"/v1/sessions/{sid}/run", json={"command": "echo acme-secret"}).status_code == 200
    snap = acme.post(f"/v1/sessions/{sid}/snapshots")
    assert snap.status_code == 201, snap.text
    snap_id = snap.json()["snapshot_id"]
    support_wait(lambda: with_command(acme, sid, "echo acme-secret"), 10)  # its record is in
    assert acme.delete(f"/v1/sessions/{sid}").status_code == 204

    # globex takes the id; then acme deletes its snapshot of its (deleted) session.
    assert globex.post("/v1/sessions", json={"session_id": sid}).status_code == 201
    assert globex.post(f"/v1/sessions/{sid}/run", json={"command": "echo globex-own"}).status_code == 200
    assert acme.delete(f"/v1/snapshots/{snap_id}").status_code == 204
    theirs = support_wait(lambda: with_command(globex, sid, "echo globex-own"), 10)
    shown = json.dumps(theirs)
    assert "acme-secret" not in shown and snap_id not in shown and '"acme"' not in shown, shown
    entries = theirs["entries"]
    assert entries[0]["type"] == "session.created" and {e["incarnation"] for e in entries} == {2}
    assert {e.get("org_id") for e in entries} <= {None, "globex"}

    # acme keeps its own life (an audit record outlives the id), and nothing of globex's.
    mine = page(acme, sid)
    assert "echo acme-secret" in commands_of(mine) and "globex-own" not in json.dumps(mine)
    assert {e["incarnation"] for e in mine["entries"]} == {1}
    assert "snapshot.deleted" in [e["type"] for e in mine["entries"]]  # its own delete, made later
    # An organisation that never had the id: as if it never was.
    never = orgs["initech"].get(f"/v1/sessions/{sid}/timeline")
    missing = orgs["initech"].get("/v1/sessions/tl-never-was/timeline")
    assert never.status_code == missing.status_code == 404
    assert never.json()["message"].replace(sid, "ID") == missing.json()["message"].replace(
        "tl-never-was", "ID"
    )

    # The operator's key: both lives, each entry with its incarnation (acme's snapshot was
    # deleted during globex's life: in stream order, but of incarnation 1).
    every = page(client, sid)["entries"]
    assert [e["seq"] for e in every if e["incarnation"] == 1] == [e["seq"] for e in mine["entries"]]
    assert [e["seq"] for e in every if e["incarnation"] == 2] == [
        e["seq"] for e in page(globex, sid)["entries"]
    ]
    text = sbx(state_dir, "timeline", sid)
    assert text.returncode == 0 and "-- incarnation 2 --" in text.stdout, text.stderr

    # A followed timeline: globex's shows what there is of its own life, never acme's.
    with globex.stream("GET", f"/v1/sessions/{sid}/timeline", params={"follow": "true"}) as answer:
        followed = []
        for line in answer.iter_lines():
            if line:
                followed.append(json.loads(line))
            if len(followed) == len(entries):
                break
    assert [e["seq"] for e in followed] == [e["seq"] for e in entries]

    # The console: globex's session page and audit page hold nothing of acme's life.
    with console_login(url, ORG_KEYS["globex"]) as console:
        session_page = console.get(f"/console/sessions/{sid}")
        assert session_page.status_code == 200 and "globex-own" in session_page.text
        assert "acme-secret" not in session_page.text and snap_id not in session_page.text
        audit = console.get("/console/audit")
        assert audit.status_code == 200 and "globex-own" in audit.text
        assert "acme-secret" not in audit.text and snap_id not in audit.text
    with console_login(url, ORG_KEYS["acme"]) as console:
        audit = console.get("/console/audit")  # (the same window of the stream: acme's life is in it)
        assert "acme-secret" in audit.text and "globex-own" not in audit.text
        assert console.get(f"/console/sessions/{sid}").status_code == 404  # the id is globex's now


def answer(response: httpx.Response, snapshot_id: str) -> tuple[int, str, str]:
    body = response.json()
    return response.status_code, body["error"], body["message"].replace(snapshot_id, "ID")


def test_another_organisations_snapshot_id_answers_as_a_missing_one(client, orgs):
    acme, globex = orgs["acme"], orgs["globex"]
    for org, sid in ((acme, "tl-snap-a"), (globex, "tl-snap-g")):
        assert org.post("/v1/sessions", json={"session_id": sid}).status_code == 201
        assert org.post(f"/v1/sessions/{sid}/run", json={"command": "true"}).status_code == 200
    taken = acme.post("/v1/sessions/tl-snap-a/snapshots")
    assert taken.status_code == 201, taken.text
    theirs, nowhere = taken.json()["snapshot_id"], "snap-" + "0" * 20
    for method, path, body in (
        ("GET", "/v1/snapshots/{}", None),
        ("DELETE", "/v1/snapshots/{}", None),
        ("PUT", "/v1/snapshots/{}/warm", {"count": 1}),
        ("POST", "/v1/snapshots/{}/forks", {"count": 1}),
        ("POST", "/v1/snapshots/{}/forks", {"session_ids": ["tl-snap-fork"]}),
    ):
        foreign = globex.request(method, path.format(theirs), json=body)
        missing = globex.request(method, path.format(nowhere), json=body)
        assert answer(foreign, theirs) == answer(missing, nowhere) and foreign.status_code == 404, (
            method,
            path,
        )
    restore = [
        globex.post("/v1/sessions/tl-snap-g/restore", json={"snapshot_id": s}) for s in (theirs, nowhere)
    ]
    assert answer(restore[0], theirs) == answer(restore[1], nowhere) and restore[0].status_code == 404
    assert globex.get("/v1/snapshots", params={"session_id": "tl-snap-a"}).json()["count"] == 0

    # Creating one with an id of its choice: refused alike, whether another organisation has it.
    chosen = [
        globex.post("/v1/sessions/tl-snap-g/snapshots", json={"snapshot_id": s}) for s in (theirs, "free-1")
    ]
    assert answer(chosen[0], theirs) == answer(chosen[1], "free-1") and chosen[0].status_code == 400
    # The same Idempotency-Key in two organisations names two snapshots (a retry, the same one).
    key = {"Idempotency-Key": "same-key-" + uuid.uuid4().hex}
    mine = [acme.post("/v1/sessions/tl-snap-a/snapshots", headers=key) for _ in range(2)]
    other = globex.post("/v1/sessions/tl-snap-g/snapshots", headers=key)
    assert mine[0].status_code == mine[1].status_code == other.status_code == 201, other.text
    assert mine[0].json()["snapshot_id"] == mine[1].json()["snapshot_id"] != other.json()["snapshot_id"]
    # acme's snapshot is untouched; the operator still chooses ids.
    assert acme.get(f"/v1/snapshots/{theirs}").json()["status"] == "ready"
    assert (
        client.post("/v1/sessions/tl-snap-g/snapshots", json={"snapshot_id": "tl-op-chosen"}).status_code
        == 201
    )
