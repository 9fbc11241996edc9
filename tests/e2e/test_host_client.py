"""The agent-host client against a real `sbx up`: `Sandbox` and `sbx exec` run commands in
real sandboxes, files go up and come back, git network commands run on this host with
its credentials (a local smart-HTTP remote that requires them), output streams, Ctrl-C
stops, --keep/release share or free the sandbox, and what a sandbox does to .git
internals stays in the sandbox."""

from __future__ import annotations

import base64
import os
import re
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from sbx_api import hostapi
from sbx_client import Sandbox, transport
from tests import support
from tests.e2e.stacks import running_stack
from tests.proxy import harness

pytestmark = [pytest.mark.needs_root("the local runtime needs root"), pytest.mark.slow]
TOKEN = "host-only-token-5b1f"
BASIC = base64.b64encode(f"x-access-token:{TOKEN}".encode()).decode()
IDENT = ("-c", "user.name=Host", "-c", "user.email=host@example.com")


ORG_KEYS = {"acme": "acme-key-5b1f0123456789", "globex": "globex-key-5b1f012345678"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    state = tmp_path_factory.mktemp("stack")
    keys = state.parent / "org-keys"
    keys.write_text("".join(f"{org} {key}\n" for org, key in ORG_KEYS.items()))
    with running_stack(state, SBX_ORG_KEYS=str(keys)) as (_, url):
        yield state, url, (state / "api-key").read_text().strip()


@pytest.fixture
def client_env(stack, tmp_path):
    state, url, key = stack
    home = tmp_path / "home"
    home.mkdir()
    (home / ".gitconfig").write_text(
        "[user]\n\tname = Host User\n\temail = host@example.com\n"
        f"[http]\n\textraHeader = Authorization: Basic {BASIC}\n[alias]\n\tevil = !touch /tmp/pwned\n"
    )
    return {
        "PATH": os.environ["PATH"], "HOME": str(home), "SBX_URL": url, "SANDBOX_API_KEY": key,
        "SBX_CLIENT_STATE_DIR": str(tmp_path / "client-state"),
    }  # fmt: skip


def git(*args: str, cwd) -> str:
    return subprocess.run(["git", *IDENT, *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path):
    repo = tmp_path / "work" / "repo"
    repo.mkdir(parents=True)
    git("init", "-q", "-b", "main", cwd=repo)
    (repo / "f.txt").write_text("x\n")
    (repo / "old.txt").write_text("old\n")
    (repo / "run.sh").write_text("#!/bin/sh\necho run\n")
    git("add", "-A", cwd=repo)
    git("commit", "-qm", "one", cwd=repo)
    return repo


@pytest.fixture
def remote(tmp_path):
    with harness.git_remote(tmp_path, TOKEN) as served:
        yield served


def test_a_build_edits_and_commits_and_everything_comes_back(client_env, repo):
    with Sandbox(cwd=repo, session="build-1", env=client_env) as sb:
        result = sb.execute(
            "pwd; sed -i s/x/y/ f.txt && echo built > out.txt && rm old.txt && mkdir -p gen/deep && "
            "head -c 3000000 /dev/urandom > gen/deep/blob.bin && chmod +x run.sh && ln -s f.txt link && "
            "git add -A && git commit -qm 'from the sandbox' && git log --format=%s -n 1"
        )
        assert result["exit_code"] == 0, result["output"]
        assert result["output"].splitlines()[0] == "/workspace/repo"
        assert "from the sandbox" in result["output"]
        blob = sb.execute("sha256sum gen/deep/blob.bin")["output"].split()[0]
    assert (repo / "f.txt").read_text() == "y\n"
    assert (repo / "out.txt").read_text() == "built\n"
    assert not (repo / "old.txt").exists()
    assert os.access(repo / "run.sh", os.X_OK)
    assert os.readlink(repo / "link") == "f.txt"
    import hashlib

    assert hashlib.sha256((repo / "gen/deep/blob.bin").read_bytes()).hexdigest() == blob
    assert git("log", "--format=%s", "-n", "1", cwd=repo).strip() == "from the sandbox"
    assert git("status", "--porcelain", cwd=repo) == ""


def test_git_push_runs_on_the_host_with_credentials_the_sandbox_never_sees(client_env, repo, remote):
    server, bare = remote
    port = server.server_address[1]
    git("remote", "add", "origin", f"http://127.0.0.1:{port}/org/remote.git", cwd=repo)
    with Sandbox(cwd=repo, session="push-1", env=client_env) as sb:
        made = sb.execute("echo change > pushed.txt && git add pushed.txt && git commit -qm 'to push'")
        assert made["exit_code"] == 0, made["output"]
        seen = sb.execute(
            "env; git config --list --show-origin; cat /workspace/.sbx-host/gitconfig .git/config"
        )
        assert BASIC not in seen["output"] and "evil" not in seen["output"]
        assert "Host User" in seen["output"]  # the allowlisted identity did go in
    # The CLI, as an agent calls it: the push runs on this host, with the credential in
    # the host's git config (HOME), and reaches the remote that requires it.
    pushed = subprocess.run(
        [sys.executable, "-m", "sbx.cli", "exec", "--session", "push-1", "--",
         "git push origin HEAD:refs/heads/main"],
        cwd=repo, env={**client_env, "PYTHONPATH": str(support.ROOT)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert pushed.returncode == 0, pushed.stderr
    assert git("--git-dir", str(bare), "log", "--format=%s", "main", cwd=repo).splitlines()[0] == "to push"
    # Without the host's credential the remote refuses: the credential is what got it in.
    refused = subprocess.run(
        [sys.executable, "-m", "sbx.cli", "exec", "--session", "push-1", "--",
         "git push origin HEAD:refs/heads/other"],
        cwd=repo, env={**client_env, "HOME": str(repo.parent), "PYTHONPATH": str(support.ROOT)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert refused.returncode == 128, refused.stderr  # git: no credential, and no prompt on the host
    assert any("git-receive-pack" in s["path"] for s in server.seen)


def test_output_streams_exit_codes_pass_through_and_a_run_can_be_stopped(client_env, repo, stack):
    _, url, key = stack
    with Sandbox(cwd=repo, session="stream-1", env=client_env) as sb:
        side = transport.Transport(url, key)
        released = []

        def output(stream: str, data: bytes) -> None:
            if b"first" in data and not released:
                # The command cannot finish until this runs: proof the output came live.
                side.run("stream-1", hostapi.RunBody(command="touch /tmp/go"), lambda *_: None)
                released.append(True)

        result = sb.stream(
            "echo first; until [ -e /tmp/go ]; do sleep 0.05; done; echo second", output=output
        )
        assert released and result.exit_code == 0
        assert sb.execute("exit 7")["exit_code"] == 7
        assert sb.execute("echo to-err >&2; exit 0")["output"] == "to-err\n"

        started = threading.Event()
        stopper = threading.Thread(target=lambda: (started.wait(30), sb.stop()))
        stopper.start()
        stopped = sb.stream("echo started; sleep 300", output=lambda s, d: started.set())
        stopper.join()
        assert stopped.exit_code == 128 + signal.SIGKILL

        timed = sb.stream("sleep 300", timeout=1)
        assert timed.timed_out
        side.close()


def test_what_the_sandbox_does_to_git_internals_stays_there(client_env, repo, tmp_path):
    config_before = (repo / ".git" / "config").read_text()
    with Sandbox(cwd=repo, session="git-1", keep=False, env=client_env) as sb:
        result = sb.stream(
            "mkdir -p .git/hooks && printf '#!/bin/sh\\ntouch /tmp/hooked\\n' > .git/hooks/pre-push && "
            "chmod +x .git/hooks/pre-push && "
            "git config alias.x '!touch /tmp/pwned' && git config core.fsmonitor 'touch /tmp/pwned' && "
            "mkdir -p .git/objects/info && echo /elsewhere > .git/objects/info/alternates && "
            "ln -s /etc/passwd escape && "
            "ln -s ../../outside up && mkdir sub && echo 'gitdir: /tmp/evil' > sub/.git && "
            "mkdir -p Sub2/.GIT && echo x > Sub2/.GIT/config",
        )
        assert result.exit_code == 0
        refused = dict(result.refused)
        assert {".git/hooks/pre-push", ".git/objects/info/alternates", "escape", "up", "sub/.git"} <= set(
            refused
        )
        assert not (repo / ".git" / "hooks" / "pre-push").exists()
        assert (repo / ".git" / "config").read_text() == config_before
        assert not (repo / "escape").exists() and not (repo / "up").exists()
        assert not (repo / "sub" / ".git").exists() and not (repo / "Sub2" / ".GIT").exists()
        # The next round replaces what the sandbox changed with the host's version.
        again = sb.execute("ls .git/hooks/pre-push 2>&1; git config --get alias.x; echo done")
        assert "No such file" in again["output"] and "touch" not in again["output"]


def test_a_sandbox_that_removes_the_whole_tree_removes_nothing_on_the_host(client_env, repo):
    with Sandbox(cwd=repo, session="rm-1", env=client_env) as sb:
        result = sb.stream("cd / && rm -rf /workspace/repo")
        assert result.exit_code == 0
        assert result.refused and "incomplete" in result.refused[0][1]
    assert (repo / "f.txt").exists() and (repo / ".git" / "HEAD").exists()


def test_only_named_variables_sync_paths_and_task_files_go_in(client_env, repo, tmp_path):
    shared_lib = tmp_path / "work" / "common"
    shared_lib.mkdir()
    (shared_lib / "lib.txt").write_text("lib\n")
    task = tmp_path / "TASK.md"
    task.write_text("do the thing\n")
    env = {
        **client_env, "FOO": "forwarded", "HOST_SECRET": "never",
        "SBX_FORWARD_ENV": "FOO MISSING", "SBX_SYNC_PATHS": str(shared_lib), "SBX_TASK_FILES": str(task),
    }  # fmt: skip
    with Sandbox(cwd=repo, session="env-1", env=env) as sb:
        out = sb.execute(
            'echo "[$FOO][${HOST_SECRET:-}][${MISSING-unset}]"; '
            'cat ../common/lib.txt "$SBX_TASK_DIR/TASK.md"; '
            "echo changed > ../common/lib.txt"
        )["output"]
    assert out.splitlines() == ["[forwarded][][unset]", "lib", "do the thing"]
    assert (shared_lib / "lib.txt").read_text() == "lib\n"  # sync paths go one way


def test_cli_keep_release_and_ctrl_c(client_env, repo):
    env = {**client_env, "PYTHONPATH": str(support.ROOT)}

    def sbx(*args: str, **kw) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "sbx.cli", *args]
        return subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True, timeout=120, **kw)

    first = sbx("exec", "--session", "cli-1", "--keep", "--", "echo kept > /tmp/marker; echo made > made.txt")
    assert first.returncode == 0, first.stderr
    assert (repo / "made.txt").read_text() == "made\n"
    second = sbx("exec", "--session", "cli-1", "--keep", "--", "cat /tmp/marker; exit 4")
    assert second.returncode == 4 and second.stdout == "kept\n"
    released = sbx("release", "--session", "cli-1")
    assert released.returncode == 0 and "released" in released.stdout
    fresh = sbx("exec", "--session", "cli-1", "--", "cat /tmp/marker 2>&1 || echo fresh")
    assert fresh.stdout.strip().endswith("fresh")

    proc = subprocess.Popen(
        [sys.executable, "-m", "sbx.cli", "exec", "--session", "cli-2", "--", "echo ready; sleep 300"],
        cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 130


def test_the_host_api_refuses_bad_input_and_a_stale_sandbox(stack):
    _, url, key = stack
    auth = {"Authorization": f"Bearer {key}"}
    assert httpx.post(f"{url}/v1/sessions/api-1/run", json={"command": "true"}).status_code == 401
    bad = httpx.post(f"{url}/v1/sessions/api-1/files/get", json={"root": "/etc", "paths": []}, headers=auth)
    assert bad.status_code == 400 and "/workspace" in bad.json()["message"]
    extra = httpx.post(f"{url}/v1/sessions/api-1/run", json={"command": "true", "rogue": 1}, headers=auth)
    assert extra.status_code == 400
    for body, said in (
        ({"command": "echo a\x00b"}, "NUL"),
        ({"command": "true", "timeout": 1e300}, "timeout must be more than 0"),
        ({"command": "true", "cwd": "workspace"}, "cwd must be absolute"),
        ({"command": "true", "env": {"1X": "y"}}, "not a variable name"),
    ):
        refused = httpx.post(f"{url}/v1/sessions/api-new/run", json=body, headers=auth)
        assert refused.status_code == 400 and said in refused.json()["message"], refused.text
    # Refused before anything was claimed: the session was never made.
    assert httpx.get(f"{url}/v1/sessions/api-new", headers=auth).status_code == 404
    stale = httpx.post(
        f"{url}/v1/sessions/api-1/run",
        json={"command": "true", "sandbox_id": "sb-not-this-one"},
        headers=auth,
    )
    assert stale.status_code == 409 and stale.json()["error"] == "sandbox_changed"
    spec = httpx.get(f"{url}/openapi.json").json()
    assert {"/v1/sessions/{session_id}/run", "/v1/sessions/{session_id}/files/put"} <= set(spec["paths"])


def test_a_kept_sandbox_gets_only_what_changed_on_the_host(client_env, repo):
    with Sandbox(cwd=repo, session="inc-1", keep=True, env=client_env) as sb:
        assert sb.stream("true").sent > 0
        unchanged = sb.stream("true")
        assert unchanged.sent == 0 and unchanged.written == [] and unchanged.deleted == []
        (repo / "f.txt").write_text("host edit\n")
        (repo / "old.txt").unlink()
        (repo / "newdir").mkdir()
        (repo / "newdir" / "n").write_text("n\n")
        out: list[bytes] = []
        result = sb.stream(
            "cat f.txt; ls old.txt 2>&1; cat newdir/n; echo made > m.txt", output=lambda s, d: out.append(d)
        )
        assert result.sent == 4, result  # f.txt, old.txt (deleted), newdir, newdir/n
        assert result.written == ["m.txt"] and result.deleted == []
        text = b"".join(out).decode()
        assert "host edit" in text and "No such file" in text and "n\n" in text
    # Another client (a new process with --keep) continues from what was recorded.
    with Sandbox(cwd=repo, session="inc-1", keep=True, env=client_env) as again:
        assert again.stream("test -f m.txt").exit_code == 0
        assert again.stream("true").sent == 0
        assert again.release()


def test_package_caches_are_shared_within_an_organisation_and_never_across(client_env, repo, stack):
    state, _, _ = stack
    write = 'mkdir -p "$PIP_CACHE_DIR" && echo wheel > "$PIP_CACHE_DIR/shared.whl"'
    read = 'cat "$PIP_CACHE_DIR/shared.whl" 2>/dev/null || echo none'
    with Sandbox(cwd=repo, session="cache-a1", env=client_env, org_id="acme") as sb:
        assert sb.execute(write)["exit_code"] == 0
    with Sandbox(cwd=repo, session="cache-a2", env=client_env, org_id="acme") as sb:
        assert sb.execute(read)["output"] == "wheel\n"
    with Sandbox(cwd=repo, session="cache-g1", env=client_env, org_id="globex") as sb:
        assert sb.execute(read)["output"] == "none\n"
    with Sandbox(cwd=repo, session="cache-none", env=client_env) as sb:
        assert sb.execute(read)["output"] == "none\n"
    events = subprocess.run(
        [sys.executable, "-m", "sbx.cli", "events", "--state-dir", str(state)],
        capture_output=True, text=True, timeout=60, cwd=support.ROOT,
    )  # fmt: skip
    # Recorded when the cache was shown: on a session's first call in a pool sandbox
    # (sandbox.cache_attached), or from the start of a sandbox made for the session
    # (a cold start: sandbox.requested's cache_org).
    shown = re.compile(r"sandbox\.cache_attached .*org_id=(\S+)|sandbox\.requested .*cache_org=(\S+)")
    orgs = {(m.group(1) or m.group(2)) for line in events.stdout.splitlines() if (m := shown.search(line))}
    assert orgs == {"acme", "globex"}, events.stdout[-3000:]


def test_the_documented_example_runs(client_env, repo):
    env = {**client_env, "PYTHONPATH": str(support.ROOT)}
    done = subprocess.run(
        [sys.executable, str(support.ROOT / "examples" / "host_client.py"), str(repo)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "back on the host: made in the sandbox" in done.stdout
    assert "stdout: step 3" in done.stdout and "would run on the host" in done.stdout


def test_a_key_bound_to_an_organisation_never_reaches_anothers_sessions(client_env, repo, stack):
    """With SBX_ORG_KEYS, a key acts for its organisation only: X-Org-Id cannot be
    spoofed, another organisation's session cannot be run, read, stopped or listed, and
    the cache is the key's organisation's."""
    _, url, operator = stack
    acme = {**client_env, "SANDBOX_API_KEY": ORG_KEYS["acme"]}
    globex = {**client_env, "SANDBOX_API_KEY": ORG_KEYS["globex"]}
    with Sandbox(cwd=repo, session="org-a1", env=acme, keep=True) as sb:
        assert sb.execute('mkdir -p "$PIP_CACHE_DIR" && echo acme > "$PIP_CACHE_DIR/who"')["exit_code"] == 0
    with Sandbox(cwd=repo, session="org-a1", env=globex) as sb:
        with pytest.raises(transport.ApiError) as refused:
            sb.execute("cat /workspace/repo/f.txt")
        assert refused.value.status == 409 and "another organisation" in refused.value.message
        sb.keep = True  # nothing to release: it never got the session
    spoof = httpx.post(
        f"{url}/v1/sessions/org-g1/run",
        json={"command": "true"},
        headers={"Authorization": f"Bearer {ORG_KEYS['globex']}", "X-Org-Id": "acme"},
    )
    assert spoof.status_code == 403
    as_globex = {"Authorization": f"Bearer {ORG_KEYS['globex']}"}
    assert httpx.get(f"{url}/v1/sessions/org-a1", headers=as_globex).status_code == 404
    assert httpx.post(f"{url}/v1/sessions/org-a1/stop", headers=as_globex).status_code == 404
    assert httpx.delete(f"{url}/v1/sessions/org-a1", headers=as_globex).status_code == 404
    listed = httpx.get(f"{url}/v1/sessions", headers=as_globex).json()
    assert "org-a1" not in {s["session_id"] for s in listed["sessions"]}
    with Sandbox(cwd=repo, session="org-g1", env=globex) as sb:
        assert sb.execute('cat "$PIP_CACHE_DIR/who" 2>/dev/null || echo none')["output"] == "none\n"
    # The operator's key reaches every session.
    as_operator = {"Authorization": f"Bearer {operator}"}
    assert httpx.delete(f"{url}/v1/sessions/org-a1", headers=as_operator).status_code == 204


def test_a_command_that_leaves_a_process_running_still_returns(client_env, repo):
    """`cmd &` (a daemon, a dev server) keeps the command's output open; the run ends when
    the command does, and says so, instead of waiting for what it left behind."""
    with Sandbox(cwd=repo, session="bg-1", env=client_env) as sb:
        out: list[bytes] = []
        result = sb.stream("sleep 300 & echo started; echo made > bg.txt", output=lambda s, d: out.append(d))
        assert result.exit_code == 0 and result.written == ["bg.txt"]
        text = b"".join(out).decode()
        assert "started" in text and "left running" in text
