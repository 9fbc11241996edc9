"""No secret the stack holds reaches a sandbox (security checklist, "Secrets scan").

A real `sbx up` is given every kind of secret an operator has: the API key, an
organisation key, the embedded NATS token it generates, proxy credentials from
``token_env``/``password_env`` and a GitHub App key from ``private_key_env``, plus an
unrelated secret in the shell it is started from. Then, from inside sandboxes as root
and as uid 1000 (claimed over MCP, so started by the pool-manager and entered by the
executor as in production), everything visible is dumped: every ``/proc/*/environ``,
``cmdline``, open file descriptor (target and, for files, contents), the mount table,
and every file outside ``/usr``, ``/proc``, ``/sys`` and ``/dev``. The dump is read from
the host and must hold none of the secrets. The services' own environments are checked
from the host too: each holds only what it needs.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest

from shared.infrastructure import processes
from tests.e2e import stacks
from tests.e2e.agent import Agent

pytestmark = [pytest.mark.needs_root("the local runtime needs root"), pytest.mark.slow]

SCAN = r"""
out=/workspace/scan-$TAG.txt
{
for p in /proc/[0-9]*; do
    echo "== $p"
    cat "$p/environ" "$p/cmdline" 2>/dev/null; echo
    for f in "$p"/fd/*; do
        target=$(readlink "$f" 2>/dev/null)
        echo "fd $f -> $target"
        case "$target" in "$out"|pipe:*|socket:*|anon_inode:*) continue;; esac
        [ -f "$f" ] && head -c 1048576 "$f" 2>/dev/null
    done
    cat "$p/mountinfo" 2>/dev/null
done
find / \( -path /proc -o -path /sys -o -path /dev -o -path /usr -o -path /workspace \) -prune \
    -o -type f -size -2M -print 2>/dev/null |
    while read -r f; do [ -f "$f" ] && echo "== $f" && cat "$f"; done
find /workspace -type f ! -name 'scan-*' -exec cat {} + 2>/dev/null
} > "$out" 2>&1
echo scanned $(wc -c < "$out")
"""


def _private_key() -> str:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()


@pytest.fixture
def secret_stack(tmp_path):
    state = tmp_path / "state"
    pem = _private_key()
    values = {
        "SANDBOX_API_KEY": "sk-api-" + secrets.token_hex(16),
        "SBX_GITHUB_TOKEN": "ghs_" + secrets.token_hex(16),  # an SBX_ name: still only for the proxy
        "PROXY_PASSWORD": "pw-" + secrets.token_hex(16),
        "GITHUB_APP_KEY": pem,
        "AWS_SECRET_ACCESS_KEY": "aws-" + secrets.token_hex(16),  # the operator's, needed by nothing
    }
    org_key = "sk-org-" + secrets.token_hex(16)
    org_keys = tmp_path / "org-keys"
    org_keys.write_text(f"acme {org_key}\n")
    config = tmp_path / "proxy.toml"
    config.write_text(
        """
[[rules]]
kind = "bearer"
hosts = ["api.example.com"]
token_env = "SBX_GITHUB_TOKEN"

[[rules]]
kind = "basic"
hosts = ["git.example.com"]
username = "x-access-token"
password_env = "PROXY_PASSWORD"

[[rules]]
kind = "github_app"
hosts = ["github.com"]
app_id = 1
installation_id = 2
private_key_env = "GITHUB_APP_KEY"
"""
    )
    extra = {**values, "SBX_ORG_KEYS": str(org_keys), "SBX_PROXY_CONFIG": str(config)}
    with stacks.running_stack(state, **extra) as (proc, url):
        nats_token = (state / "nats-token").read_text().strip()
        found = {**values, "org key": org_key, "NATS token": nats_token}
        # The key's body, line by line: any part of it is a leak.
        found |= {f"app key line {i}": line for i, line in enumerate(pem.splitlines()[1:-1])}
        yield state, url, found


def _leaks(text: str, found: dict[str, str]) -> list[str]:
    return [name for name, value in found.items() if value.strip() in text]


async def test_no_secret_is_visible_inside_a_sandbox(secret_stack):
    state, url, found = secret_stack
    key = found["SANDBOX_API_KEY"]
    for tag, root in (("root", True), ("user", False)):
        agent = Agent(url, key, f"scan-{tag}")
        ok, text = await agent.call("shell", command="id -u")
        assert ok, text
        ok, text = await agent.call("create_sandbox", run_as_root=root)
        assert ok, text
        ok, text = await agent.call("shell", command="id -u; grep Seccomp: /proc/self/status")
        assert ok and text.split()[0] == ("0" if root else "1000"), text
        ok, text = await agent.call("shell", command=f"export TAG={tag}\n{SCAN}", timeout=120)
        assert ok and "scanned" in text, text
        (dump,) = stacks.sandbox_files(state, f"/workspace/scan-{tag}.txt")  # its own filesystem
        content = dump.read_text(errors="replace")
        assert "== /proc/1\n" in content  # the scan saw pid 1
        assert len(content) > 10_000, "the scan read almost nothing"
        assert _leaks(content, found) == [], tag


def test_each_service_gets_only_the_variables_it_needs(secret_stack):
    state, _url, found = secret_stack
    report = stacks.support_wait(lambda: (s := stacks.status(state))["rc"] == 0 and s)
    proxy_vars = {"SBX_GITHUB_TOKEN", "PROXY_PASSWORD", "GITHUB_APP_KEY"}
    for instance in report["services"]:
        env = _environ(instance["pid"])
        held = {name for name, value in found.items() if value in env.values()}
        if instance["service"] == "gateway":
            assert held == {"SANDBOX_API_KEY", "NATS token"}, held
        elif instance["service"] == "proxy-scaler":
            assert held == proxy_vars | {"NATS token"}, held
        else:
            assert held == {"NATS token"}, (instance["service"], held)
        assert "AWS_SECRET_ACCESS_KEY" not in env

    def proxies_checked() -> int:
        """Every live proxy's variables; how many were read (an idle fleet shrinks: a
        proxy may stop between its record being listed and its variables being read)."""
        checked = 0
        for path in (state / "proxies").glob("*.json"):
            try:
                record = json.loads(path.read_text())
                env = _environ(record["pid"])
            except FileNotFoundError:
                continue
            if processes.start_time(record["pid"]) != record["starttime"]:
                continue  # (its pid is another process's now)
            held = {name for name, value in found.items() if value in env.values()}
            assert held == proxy_vars, held
            checked += 1
        return checked

    assert stacks.support_wait(proxies_checked), "no proxy is running"


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)
