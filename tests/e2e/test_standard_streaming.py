"""Standard streaming against a real `sbx up` (issue 20, item 2): a run's output as NDJSON
and server-sent events, files as plain tar bodies, through real curl and Node's `fetch`
(the WHATWG API browsers have): the documented examples in docs/local-dev.md are run as
they are, then the edges (bad input before a claim, a missing path, not a tar, Accept)."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import tarfile

import httpx
import pytest

from sbx_api import hostapi
from tests import support
from tests.e2e.stacks import running_stack

pytestmark = [pytest.mark.needs_root("the local runtime needs root"), pytest.mark.slow]
DOC = support.ROOT / "docs" / "local-dev.md"


def doc_block(name: str) -> str:
    """The fenced block after ``<!-- ci-run: name -->`` in docs/local-dev.md."""
    found = re.search(rf"<!-- ci-run: {name} -->\n```\w+\n(.*?)\n```", DOC.read_text(), re.S)
    assert found, f"no ci-run block {name!r} in {DOC}"
    return found.group(1)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    state = tmp_path_factory.mktemp("stack")
    with running_stack(state) as (_, url):
        yield url, (state / "api-key").read_text().strip()


@pytest.fixture
def client(stack):
    url, key = stack
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
        yield client


def events(lines: list[str]) -> list[dict]:
    return [json.loads(line) for line in lines if line]


def test_the_documented_curl_examples_run(stack, tmp_path):
    url, key = stack
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", doc_block("curl")],
        cwd=tmp_path, env={"PATH": os.environ["PATH"], "API": url, "KEY": key},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    ran = [json.loads(line) for line in lines[:3]]
    assert ran[0] == {"type": "stdout", "data": "hello\n"}
    assert ran[1] == {"type": "stderr", "data": "oops\n"}
    assert ran[2]["type"] == "exit" and ran[2]["exit_code"] == 3 and ran[2]["sandbox_id"]
    assert "event: stdout" in done.stdout and 'data: {"type":"stdout","data":"as events\\n"}' in done.stdout
    assert "event: exit" in done.stdout
    written = next(json.loads(line) for line in lines if line.startswith('{"sandbox_id"'))
    assert written["sandbox_id"] == ran[2]["sandbox_id"]
    assert sorted(lines[-4:-1]) == ["out.txt", "src/", "src/main.py"]
    assert lines[-1] == "hi from the sandbox"


def test_the_documented_fetch_example_runs(stack, tmp_path):
    url, key = stack
    script = f"const API = {json.dumps(url)}, KEY = {json.dumps(key)};\n" + doc_block("fetch")
    done = subprocess.run(
        [shutil.which("node") or "node", "--input-type=module", "-e", script],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["out: line 1", "out: line 2", "out: line 3", "exit: 0"]


def test_output_arrives_as_it_is_written(client):
    """The first line is read while the command still runs (it waits for a file the test
    writes only after reading it)."""
    command = "echo first; while [ ! -e /tmp/go ]; do sleep 0.05; done; echo second"
    with client.stream("POST", "/v1/sessions/live-1/run", json={"command": command, "timeout": 60}) as answer:
        assert answer.status_code == 200 and answer.headers["content-type"] == hostapi.NDJSON
        assert re.fullmatch(r"[0-9a-f]{32}", answer.headers["x-run-id"])
        lines = answer.iter_lines()
        assert json.loads(next(lines)) == {"type": "stdout", "data": "first\n"}
        released = client.post("/v1/sessions/live-1/run", json={"command": "touch /tmp/go"})
        assert events(released.text.splitlines())[-1]["exit_code"] == 0
        rest = events(list(lines))
    assert rest[0] == {"type": "stdout", "data": "second\n"} and rest[-1]["exit_code"] == 0


def test_text_split_between_chunks_is_kept_whole_and_bad_bytes_are_replaced(client):
    command = r"printf '\303'; sleep 0.3; printf '\251\n'; printf '\377\n' >&2"
    got = events(client.post("/v1/sessions/utf8-1/run", json={"command": command}).text.splitlines())
    out = "".join(e["data"] for e in got if e["type"] == "stdout")
    err = "".join(e["data"] for e in got if e["type"] == "stderr")
    assert out == "é\n" and err == "\ufffd\n"


def test_server_sent_events_and_accept(client):
    sse = client.post(
        "/v1/sessions/sse-1/run", json={"command": "echo a"}, headers={"Accept": "text/event-stream"}
    )
    assert sse.status_code == 200 and sse.headers["content-type"].startswith(hostapi.EVENT_STREAM)
    blocks = [b for b in sse.text.split("\n\n") if b]
    assert blocks[0] == 'event: stdout\ndata: {"type":"stdout","data":"a\\n"}'
    assert blocks[-1].startswith("event: exit\ndata: ")
    # Frames only when asked for by name; an Accept that admits nothing is 406, before a claim.
    framed = client.post(
        "/v1/sessions/sse-1/run", json={"command": "echo b"}, headers={"Accept": hostapi.MEDIA_TYPE}
    )
    assert framed.headers["content-type"] == hostapi.MEDIA_TYPE
    assert next(iter(hostapi.FrameReader().feed(framed.content))) == (hostapi.STDOUT, b"b\n")
    refused = client.post(
        "/v1/sessions/never-1/run", json={"command": "true"}, headers={"Accept": "text/html"}
    )
    assert refused.status_code == 406 and refused.json()["error"] == "not_acceptable"
    bad = client.post("/v1/sessions/never-1/run", json={"command": "true", "timeout": 1e300})
    assert bad.status_code == 400
    assert client.get("/v1/sessions/never-1").status_code == 404  # nothing was claimed
    # A listing comes as events of base64 bytes, before the exit.
    listed = events(
        client.post(
            "/v1/sessions/sse-1/run",
            json={"command": "mkdir -p /workspace/l && touch /workspace/l/f", "list_root": "/workspace/l"},
        ).text.splitlines()
    )
    assert [e["type"] for e in listed] == ["listing", "exit"]
    assert set(hostapi.parse_listing(base64.b64decode(listed[0]["data"]))) == {"f"}


def test_a_failure_after_the_stream_started_is_an_error_event(client):
    """A run whose sandbox is deleted under it ends with an error event, not a cut stream."""
    with client.stream("POST", "/v1/sessions/gone-1/run", json={"command": "echo up; sleep 30"}) as answer:
        lines = answer.iter_lines()
        assert json.loads(next(lines))["type"] == "stdout"
        assert client.delete("/v1/sessions/gone-1").status_code == 204
        last = events(list(lines))[-1]
    assert last["type"] in ("error", "exit"), last
    if last["type"] == "exit":  # (the kill can reach the command before the stream breaks)
        assert last["exit_code"] != 0
    else:
        assert set(last) == {"type", "error", "message", "status", "retriable"}


def test_archives_round_trip_and_refuse_what_they_cannot_do(client):
    tar = io.BytesIO()
    with tarfile.open(fileobj=tar, mode="w") as archive:
        for name, data in {
            "a/one.txt": b"1\n",
            "a/deep/two.bin": bytes(range(256)) * 4000,
            "top.txt": b"t",
        }.items():
            member = tarfile.TarInfo(name)
            member.size, member.mode = len(data), 0o640
            archive.addfile(member, io.BytesIO(data))
    put = client.put(
        "/v1/sessions/tar-1/archive",
        params={"root": "/workspace/p"},
        content=tar.getvalue(),
        headers={"Content-Type": hostapi.TAR_MEDIA_TYPE},
    )
    assert put.status_code == 200, put.text
    assert set(put.json()) == {"sandbox_id", "duration"}
    got = client.get("/v1/sessions/tar-1/archive", params={"root": "/workspace/p", "path": ["a"]})
    assert got.status_code == 200 and got.headers["content-type"] == hostapi.TAR_MEDIA_TYPE
    with tarfile.open(fileobj=io.BytesIO(got.content)) as back:
        assert sorted(back.getnames()) == ["a", "a/deep", "a/deep/two.bin", "a/one.txt"]
        assert back.extractfile("a/deep/two.bin").read() == bytes(range(256)) * 4000
        assert back.getmember("a/one.txt").mode & 0o777 == 0o640
    whole = client.get("/v1/sessions/tar-1/archive", params={"root": "/workspace/p"})
    with tarfile.open(fileobj=io.BytesIO(whole.content)) as back:
        assert "./top.txt" in back.getnames()

    unstarted = client.get("/v1/sessions/tar-never/archive")
    assert unstarted.status_code == 404 and "no running sandbox" in unstarted.json()["message"]
    assert client.get("/v1/sessions/tar-never").status_code == 404  # a GET claims nothing
    missing = client.get("/v1/sessions/tar-1/archive", params={"root": "/workspace/p", "path": "nope"})
    assert missing.status_code == 404 and "nope" in missing.json()["message"]
    no_root = client.get("/v1/sessions/tar-1/archive", params={"root": "/workspace/none"})
    assert no_root.status_code == 404 and "/workspace/none" in no_root.json()["message"]
    for params in ({"root": "/etc"}, {"path": "../x"}, {"paths": "a"}):
        bad = client.get("/v1/sessions/tar-1/archive", params=params)
        assert bad.status_code == 400, (params, bad.text)
    not_tar = client.put("/v1/sessions/tar-1/archive", content=b"x" * 2048)
    assert not_tar.status_code == 400 and not_tar.json()["error"] == "invalid_input"
    wrong_type = client.put(
        "/v1/sessions/tar-1/archive", content=tar.getvalue(), headers={"Content-Type": "text/plain"}
    )
    assert wrong_type.status_code == 415
    assert client.get("/v1/sessions/tar-1/archive", headers={"Accept": "text/html"}).status_code == 406
    # Large enough to stream past what is held back: still whole.
    big = client.post(
        "/v1/sessions/tar-1/run",
        json={"command": "head -c 5000000 /dev/urandom > /workspace/p/big; sha256sum /workspace/p/big"},
    )
    digest = events(big.text.splitlines())[0]["data"].split()[0]
    streamed = client.get("/v1/sessions/tar-1/archive", params={"root": "/workspace/p", "path": "big"})
    with tarfile.open(fileobj=io.BytesIO(streamed.content)) as back:
        assert hashlib.sha256(back.extractfile("big").read()).hexdigest() == digest
    # A failure once more than what is held back was sent breaks the connection: a client
    # never takes a cut tar for a whole one.
    with pytest.raises(httpx.RemoteProtocolError):
        client.get("/v1/sessions/tar-1/archive", params={"root": "/workspace/p", "path": ["big", "nope"]})
    proc = subprocess.run(
        ["curl", "-sS", "-o", "/dev/null", "-H", "Authorization: " + client.headers["Authorization"],
         f"{client.base_url}/v1/sessions/tar-1/archive?root=/workspace/p&path=big&path=nope"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 18, proc.stderr  # curl: "transfer closed with outstanding read data"
