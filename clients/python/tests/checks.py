"""Checks of the light client, run by tests/e2e/test_light_client.py with the Python of a
virtual environment that has only clients/python installed (no pytest, no server): plain
asserts, one line printed per check passed. SBX_URL and SANDBOX_API_KEY name the stack."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from sbx_api import hostapi
from sbx_client import ApiError, Client, Sandbox


def expect_error(code: str, status: int, call) -> ApiError:
    try:
        call()
    except ApiError as exc:
        assert (exc.code, exc.status) == (code, status), (exc.code, exc.status, exc.message)
        return exc
    raise AssertionError(f"expected {code}")


def sessions(api: Client) -> None:
    made = api.create_session("light-1", user_id="u-1")
    assert made.session_id == "light-1" and made.status == "active" and made.user_id == "u-1"
    assert api.get_session("light-1").session_id == "light-1"
    listed = api.list_sessions(user_id="u-1")
    assert [s.session_id for s in listed.sessions] == ["light-1"] and listed.count == 1
    assert api.stop_session("light-1").status == "stopped"
    expect_error("conflict", 409, lambda: api.create_session("light-1"))
    expect_error("invalid_input", 400, lambda: api.create_session("no spaces"))
    expect_error("invalid_input", 400, lambda: api.list_sessions(limit=0))
    api.delete_session("light-1")
    expect_error("not_found", 404, lambda: api.get_session("light-1"))
    expect_error("not_found", 404, lambda: api.delete_session("light-1"))
    assert api.health().status == "ok"
    key_given = "light-idem-1"
    first = api.create_session("light-2", idempotency_key=key_given)
    again = api.create_session("light-2", idempotency_key=key_given)  # the same request: its answer again
    assert first.created_at == again.created_at


def runs(api: Client) -> None:
    events = list(
        api.run("light-2", "echo hello; echo oops >&2; printf 'caf\\xc3'; printf '\\xa9\\n'; exit 3")
    )
    kinds = [type(e).__name__ for e in events]
    assert kinds[-1] == "Exit" and events[-1].exit_code == 3 and events[-1].sandbox_id, kinds
    out = "".join(e.data for e in events if isinstance(e, hostapi.Stdout))
    err = "".join(e.data for e in events if isinstance(e, hostapi.Stderr))
    assert out == "hello\ncafé\n" and err == "oops\n", (out, err)
    done = api.execute("light-2", "echo $GREETING from $(pwd)", env={"GREETING": "hi"}, cwd="/tmp")
    assert (done.stdout, done.exit_code, done.timed_out) == ("hi from /tmp\n", 0, False), done
    slow = api.execute("light-2", "sleep 30", timeout=1)
    assert slow.timed_out, slow
    expect_error("invalid_input", 400, lambda: list(api.run("light-2", "   ")))
    expect_error("invalid_input", 400, lambda: api.execute("light-2", "true", timeout=10**9))
    # Leaving the loop early closes the stream: the command stops.
    for event in api.run("light-2", "echo started; exec sleep 60"):
        if isinstance(event, hostapi.Stdout):
            break
    for _ in range(100):
        if api.execute("light-2", "pgrep -x sleep || true").stdout.strip() == "":
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the command went on after its stream was closed")


def files(api: Client) -> None:
    names = {"a.txt": b"alpha\n", "dir/ünïcode name.bin": bytes(range(256)) * 5, "dir/empty": b""}
    written = api.write_files("light-2", names, root="/workspace/up")
    assert written.sandbox_id
    for name, content in names.items():
        assert api.read_file("light-2", name, root="/workspace/up") == content, name
    tar = tarfile.open(fileobj=io.BytesIO(b"".join(api.download("light-2", "dir", root="/workspace/up"))))
    assert sorted(m.name for m in tar if m.isfile()) == ["dir/empty", "dir/ünïcode name.bin"]
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as made:
        info = tarfile.TarInfo("raw/x.txt")
        info.size = 3
        made.addfile(info, io.BytesIO(b"xyz"))
    api.upload("light-2", [buffer.getvalue()[:700], buffer.getvalue()[700:]])  # chunks
    assert api.execute("light-2", "cat raw/x.txt").stdout == "xyz"
    expect_error("not_found", 404, lambda: api.read_file("light-2", "missing.txt"))
    expect_error("invalid_input", 400, lambda: api.read_file("light-2", "../etc/passwd"))
    expect_error("invalid_input", 400, lambda: api.read_file("light-2", "dir", root="/workspace/up"))
    expect_error("invalid_input", 400, lambda: api.upload("light-2", b"not a tar at all" * 64))
    api.create_session("light-none")
    expect_error("not_found", 404, lambda: list(api.download("light-none", "x")))  # never starts one


def sandbox(api: Client) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        code = Path(tmp, "project")
        code.mkdir()
        (code / "in.txt").write_text("from the host\n")
        (code / "big.bin").write_bytes(os.urandom(3 * 1024 * 1024))
        env = {**os.environ, "HOME": tmp}
        told: list[tuple[str, int, int]] = []
        with Sandbox(cwd=code, session="light-host", env=env, progress=lambda *a: told.append(a)) as sb:
            ran = sb.execute("cat in.txt && echo made > out.txt && wc -c < big.bin")
        assert ran["exit_code"] == 0 and ran["output"] == f"from the host\n{3 * 1024 * 1024}\n", ran
        assert (code / "out.txt").read_text() == "made\n"
        size = 3 * 1024 * 1024 + len("from the host\n")
        ours = [t for t in told if t[0] == str(code)]
        assert ours[0][1:] == (0, size) and ours[-1][1:] == (size, size), told
        assert len(ours) > 3 and [t[1] for t in ours] == sorted(t[1] for t in ours)  # as it goes


def readme() -> None:
    text = Path(sys.argv[1]).read_text()
    block = text.split("<!-- ci-run: python -->\n```python\n", 1)[1].split("\n```", 1)[0]
    done = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "hello",
        "exit code 3",
        "hi from the sandbox",
        "print('hi from the sandbox')",
        done.stdout.splitlines()[4],
        "404 not_found",
    ], done.stdout
    assert "'readme-1'" in done.stdout.splitlines()[4] and done.stderr == "oops\n", done


def main() -> None:
    with Client() as api:
        for check in (sessions, runs, files, sandbox):
            check(api)
            print("ok", check.__name__, flush=True)
    readme()
    print("ok readme", flush=True)


if __name__ == "__main__":
    main()
