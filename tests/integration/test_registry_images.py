"""Images pulled from a real OCI registry (Debian's docker-registry on loopback) and run as
real sandboxes: layers with whiteouts, opaque directories and hard links; a multi-platform
index; basic and token auth; mirrors; every kind of bad input; concurrent pulls; prune.
The images are written by test code (tests/oci_registry.py) and pushed with skopeo."""

from __future__ import annotations

import asyncio
import gzip
import io
import json
import os
import shutil
import socket
import stat
import subprocess
import tarfile
import threading
import time
from pathlib import Path

import pytest

from sbx_api import errors
from shared.contract import references
from shared.runtime import api
from shared.runtime.local import layerfs, layers, oci, registry
from shared.runtime.local import runtime as local
from shared.runtime.local.registries import Registry, RegistryConfig
from tests import oci_registry as o

pytestmark = pytest.mark.needs_root("the local runtime needs root")


@pytest.fixture(scope="module")
def reg(tmp_path_factory):
    if missing := o.missing_tools():
        pytest.fail(f"missing {', '.join(missing)}: scripts/setup --dev installs them")
    running = o.Registry(tmp_path_factory.mktemp("registry")).start()
    yield running
    running.stop()


@pytest.fixture
async def rt(tmp_path, reg):
    runtime = local.LocalRuntime(tmp_path / "state", registries=o.allow(reg.host))
    yield runtime
    for info in await runtime.list():
        await runtime.delete(info.sandbox_id)


def push(reg: o.Registry, tmp_path: Path, name: str, *extra: bytes, config: dict | None = None) -> str:
    layout = tmp_path / f"layout-{name.replace('/', '-').replace(':', '-')}"
    shutil.rmtree(layout, ignore_errors=True)
    digest = o.simple_image(layout, *extra, config=config)
    reg.push(layout, name)
    return digest


async def sh(rt: local.LocalRuntime, sandbox_id: str, script: str) -> tuple[int, str]:
    result, out, err = await rt.run(sandbox_id, ["/bin/sh", "-c", script])
    return result.exit_code, (out + err).decode()


CHANGES = o.layer(
    {
        "etc/.wh.passwd": b"",  # a deletion of a lower layer's file
        "etc/motd": b"from layer 2\n",
        "data": o.Dir(),
        "data/old": b"hidden by layer 3\n",
        "data/big": b"x" * 5000,
        "data/same-layer-link": o.Link("data/big", hard=True),
        "srv": o.Dir(0o750),
        "srv/link": o.Link("../etc/motd"),
    }
)
MORE = o.layer(
    {
        "data/.wh..wh..opq": b"",  # everything below from lower layers is gone
        "data/new": b"layer 3\n",
        "etc/cross-layer-link": o.Link("etc/motd", hard=True),
        "bin/suid": b"#!/bin/sh\n",
    }
)


async def test_a_registry_image_runs_with_its_layers_and_config(reg, rt, tmp_path):
    digest = push(
        reg, tmp_path, "test/layered:1", CHANGES, MORE,
        config={"Env": ["PATH=/bin:/opt/tools", "GREETING=hello", "HOME=/nope"], "WorkingDir": "/srv/app"},
    )  # fmt: skip
    image = f"{reg.host}/test/layered:1"
    info = await rt.create(api.SandboxSpec(sandbox_id="l1", image=image))
    assert info.image_digest == digest
    await rt.start("l1")
    script = (
        "ls /data; cat /etc/motd /etc/cross-layer-link /srv/link; echo $GREETING $PATH $HOME $SBX_WORKDIR;"
        " id -u; cat /etc/passwd; ls -d /srv/app"
    )
    code, out = await sh(rt, "l1", script)
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0] == "new"  # the opaque directory hides layer 2's files
    assert lines[1:4] == ["from layer 2"] * 3  # a cross-layer hard link and a symlink
    assert lines[4] == "hello /bin:/opt/tools /root /srv/app"  # the image's Env, not its HOME
    assert lines[5] == "0"
    assert "root:x:0:0" in out and "sandbox:x:1000:1000" in out  # ours, the image's was deleted
    assert "/srv/app" in lines[-1]
    # Copy-on-write: the sandbox's changes stay in it, the shared layers are untouched.
    assert (await sh(rt, "l1", "echo changed > /etc/motd && rm /data/new && cat /etc/motd"))[1] == "changed\n"
    store = rt.images.pulled
    pulled = store.get(digest)
    assert pulled is not None and len(pulled.layers) == 3
    motd = [p / "etc" / "motd" for p in store.lower_dirs(pulled) if (p / "etc" / "motd").exists()]
    assert [p.read_text() for p in motd] == ["from layer 2\n"]


async def test_a_second_sandbox_shares_the_layers_and_a_read_only_root_stays_read_only(reg, rt, tmp_path):
    push(reg, tmp_path, "test/shared:1", CHANGES, config={"User": "4242"})
    image = f"{reg.host}/test/shared:1"
    first = await rt.pull(image)
    assert first is not None and first.fetched == 2
    second = await rt.pull(image)
    assert second is not None and second.fetched == 0 and second.digest == first.digest
    before = sorted(p.name for p in (rt.images.pulled.root / "layers").iterdir())
    for sid, root in (("s1", True), ("s2", False)):
        await rt.create(api.SandboxSpec(sandbox_id=sid, image=image, run_as_root=root, writable_root=root))
        await rt.start(sid)
    assert sorted(p.name for p in (rt.images.pulled.root / "layers").iterdir()) == before
    # No copy per sandbox: each one's own directory holds kilobytes, the layers are shared.
    for sid in ("s1", "s2"):
        used = subprocess.run(["du", "-sk", str(rt.dirs.dir(sid))], capture_output=True, text=True).stdout
        assert int(used.split()[0]) < 200, used
    code, out = await sh(
        rt, "s2", "id -u; echo $HOME; touch /etc/x 2>&1; echo ok > /workspace/f && cat /workspace/f"
    )
    assert out.splitlines()[0] == "4242"  # the image's User, when not root
    assert "Read-only file system" in out and out.endswith("ok\n"), out


async def test_a_multi_platform_index_gives_this_machines_image(reg, rt, tmp_path):
    layout = tmp_path / "multi"
    images = []
    for arch in ("arm64", "amd64", "s390x"):
        marker = o.layer({"etc/arch": arch.encode()})
        images.append((o.image_manifest(layout, [o.busybox_layer(), marker], arch=arch), arch))
    o.write_layout(layout, images)
    reg.push(layout, "test/multi:1", all_platforms=True)
    wanted = registry.machine_platform()[1]
    if wanted not in ("arm64", "amd64"):
        pytest.skip(f"no image for {wanted} in the test index")
    await rt.create(api.SandboxSpec(sandbox_id="m1", image=f"{reg.host}/test/multi:1"))
    await rt.start("m1")
    assert await sh(rt, "m1", "cat /etc/arch") == (0, wanted)
    index = references.parse(f"{reg.host}/test/nothing-for-us:1")
    only_s390x = tmp_path / "s390x"
    o.write_layout(only_s390x, [(o.image_manifest(only_s390x, [o.busybox_layer()], arch="s390x"), "s390x")])
    reg.push(only_s390x, "test/nothing-for-us:1", all_platforms=True)
    with pytest.raises(
        errors.InvalidInput, match=f"has no image for linux/{wanted} \\(it has linux/s390x\\)"
    ):
        await asyncio.to_thread(rt.images.pulled.pull, index)


async def test_a_tag_is_resolved_once_and_a_digest_pins_the_content(reg, rt, tmp_path):
    first = push(reg, tmp_path, "test/moving:1", o.layer({"etc/version": b"1"}))
    image = f"{reg.host}/test/moving:1"
    await rt.create(api.SandboxSpec(sandbox_id="t1", image=image))
    second = push(reg, tmp_path, "test/moving:1", o.layer({"etc/version": b"2"}))
    assert second != first
    # A new sandbox of the tag gets what it was resolved to (no registry round trip) ...
    assert (await rt.create(api.SandboxSpec(sandbox_id="t2", image=image))).image_digest == first
    # ... until the operator pulls again; sandboxes made before keep their digest.
    assert (await rt.pull(image, refresh=True)).digest == second
    assert (await rt.create(api.SandboxSpec(sandbox_id="t3", image=image))).image_digest == second
    for sid, version in (("t1", "1"), ("t3", "2")):
        await rt.start(sid)
        assert await sh(rt, sid, "cat /etc/version") == (0, version)
    pinned = f"{reg.host}/test/moving@{first}"
    assert (await rt.create(api.SandboxSpec(sandbox_id="t4", image=pinned))).image_digest == first


async def test_basic_auth_uses_only_the_operators_credentials(tmp_path):
    private = o.Registry(tmp_path / "private", users={"bot": "s3cret-pw"}).start()
    try:
        layout = tmp_path / "layout"
        o.simple_image(layout)
        private.push(layout, "team/tool:1", user="bot")
        ref = references.parse(f"{private.host}/team/tool:1")
        anonymous = layers.LayerStore(tmp_path / "anon", o.allow(private.host))
        with pytest.raises(errors.InvalidInput, match=r"needs credentials .*\(SBX_REGISTRIES_FILE\)"):
            anonymous.pull(ref)
        wrong = layers.LayerStore(
            tmp_path / "wrong", RegistryConfig({private.host: Registry("bot", "nope", insecure=True)})
        )
        with pytest.raises(errors.InvalidInput, match="refused") as refused:
            wrong.pull(ref)
        assert "nope" not in refused.value.message
        right = layers.LayerStore(
            tmp_path / "right", RegistryConfig({private.host: Registry("bot", "s3cret-pw", insecure=True)})
        )
        assert right.pull(ref).fetched == 1
        for store in (anonymous, wrong, right):  # nothing of a failed pull, no credential anywhere
            for path in store.root.rglob("*"):
                if path.is_file() and path.stat().st_size < 1024**2:
                    assert b"s3cret-pw" not in path.read_bytes(), path
        assert not any((tmp_path / "wrong" / "layers").iterdir())
    finally:
        private.stop()


async def test_the_token_flow_docker_hub_and_ghcr_use(tmp_path):
    """docker-registry with `auth: token` verifies the JWTs a token service signs, as
    Docker Hub's and GHCR's registries do; anonymous tokens grant nothing here."""
    tokens = o.TokenServer(tmp_path / "tokens", {"bot": "tok-pw"}).start()
    gated = o.Registry(tmp_path / "gated", auth=tokens.auth_config(), push_creds="bot:tok-pw")
    gated.start()
    try:
        layout = tmp_path / "layout"
        o.simple_image(layout)
        gated.push(layout, "org/app:2")
        ref = references.parse(f"{gated.host}/org/app:2")
        with pytest.raises(errors.InvalidInput, match="refused"):
            layers.LayerStore(tmp_path / "anon", o.allow(gated.host, tokens.host)).pull(ref)
        config = RegistryConfig(
            {gated.host: Registry("bot", "tok-pw", insecure=True), tokens.host: Registry(insecure=True)}
        )
        pulled = layers.LayerStore(tmp_path / "bot", config).pull(ref)
        assert pulled.fetched == 1
        assert ("bot", "repository:org/app:pull") in tokens.requests
    finally:
        gated.stop()
        tokens.stop()


async def test_a_mirror_is_asked_first(reg, tmp_path):
    push(reg, tmp_path, "library/mirrored:1", o.layer({"etc/from": b"mirror"}))
    config = RegistryConfig({"docker.io": Registry(mirrors=(reg.host,)), reg.host: Registry(insecure=True)})
    pulled = layers.LayerStore(tmp_path / "store", config).pull(references.parse("mirrored:1"))
    assert pulled.reference == "docker.io/library/mirrored:1" and pulled.fetched == 2


async def test_unknown_images_and_unreachable_registries_are_clear_errors(reg, rt):
    with pytest.raises(errors.NotFound, match="has no image .*test/never-pushed:1: "):
        await rt.create(api.SandboxSpec(sandbox_id="u1", image=f"{reg.host}/test/never-pushed:1"))
    with pytest.raises(errors.NotFound, match="manifest unknown"):
        await rt.pull(f"{reg.host}/test/layered:no-such-tag")
    # A host name that does not exist (.invalid never resolves, RFC 6761) says what any
    # registry that cannot be reached says: the errors tell nothing of the host's network.
    with pytest.raises(errors.Unavailable) as unknown:
        await rt.pull("no-such-registry.invalid/test/img:1")
    assert unknown.value.message.endswith(registry.UNREACHABLE.format(host="no-such-registry.invalid")), (
        unknown.value.message
    )
    # An IPv6 literal the grammar takes but no URL can hold (schemathesis found it: a 503).
    with pytest.raises(errors.InvalidInput, match=r"registry \[dfa:ad\] is not a usable address"):
        await rt.pull("[dfa:ad]/test/img:1")
    with pytest.raises(errors.InvalidInput, match="repository names"):
        await rt.create(api.SandboxSpec(sandbox_id="u2", image="Not A Reference"))
    assert list(rt.root.iterdir()) == []
    assert rt.images.pulled.all() == []


def outside_address() -> str:
    """This machine's first non-loopback IPv4 address (skips the test where it has none)."""
    listed = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    address = next((a for a in listed if "." in a), None)
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    return address


def _blob_path(reg: o.Registry, digest: str) -> Path:
    hexd = digest.split(":", 1)[1]
    return reg.root / "data" / "docker" / "registry" / "v2" / "blobs" / "sha256" / hexd[:2] / hexd / "data"


async def test_a_blob_altered_in_the_registry_is_refused_and_nothing_kept(reg, tmp_path):
    payload = o.layer({"etc/payload": b"genuine" * 100})
    push(reg, tmp_path, "test/tampered:1", payload)
    blob = _blob_path(reg, "sha256:" + __import__("hashlib").sha256(payload).hexdigest())
    forged = o.layer({"etc/payload": b"forgery" * 100})
    assert len(forged) == len(payload)
    blob.write_bytes(forged)
    store = layers.LayerStore(tmp_path / "store", o.allow(reg.host))
    with pytest.raises(errors.InvalidInput, match="does not match its digest"):
        store.pull(references.parse(f"{reg.host}/test/tampered:1"))
    assert store.all() == []
    # Not even busybox's layer, which was fine: a failed pull keeps nothing.
    assert list((store.root / "layers").iterdir()) == []
    assert list((store.root / "blobs").iterdir()) == []


@pytest.mark.parametrize(
    ("entries", "said"),
    [
        ({"../escape": b"x"}, "'..'"),
        ({"/etc/abs": b"x"}, "absolute path"),
        ({"link": o.Link("/tmp"), "link/through": b"x"}, "through the symlink"),
        ({"hard": o.Link("../../etc/shadow", hard=True)}, "'..'"),
        ({"hard": o.Link("nowhere/file", hard=True)}, "missing file"),
    ],
)
async def test_a_layer_that_tries_to_escape_is_refused(reg, tmp_path, entries, said):
    name = f"test/escape-{abs(hash(said)) % 10_000}:1"
    push(reg, tmp_path, name, o.layer(entries))
    store = layers.LayerStore(tmp_path / "store", o.allow(reg.host))
    with pytest.raises(oci.ImageError, match=said):
        store.pull(references.parse(f"{reg.host}/{name}"))
    assert store.all() == []
    assert not (tmp_path / "escape").exists() and not Path("/tmp/through").exists()
    assert not [p for p in (store.root / "layers").iterdir() if p.name.startswith(".")]


async def test_decompression_bombs_and_oversized_images_are_refused(reg, tmp_path):
    bomb = gzip.compress(o.layer({"zeros": b"\0" * (64 * 1024**2)}, compress=False), 9)
    assert len(bomb) < 256 * 1024
    push(reg, tmp_path, "test/bomb:1", bomb)
    store = layers.LayerStore(tmp_path / "store", o.allow(reg.host), max_bytes=16 * 1024**2)
    with pytest.raises(oci.ImageError, match="unpacks to more than"):
        store.pull(references.parse(f"{reg.host}/test/bomb:1"))
    assert store.all() == []
    tiny = layers.LayerStore(tmp_path / "tiny", o.allow(reg.host), max_bytes=64 * 1024)
    with pytest.raises(oci.ImageError, match="more than the limit .*SBX_IMAGE_MAX_BYTES"):
        tiny.pull(references.parse(f"{reg.host}/test/bomb:1"))


async def test_an_image_without_a_shell_is_a_clear_error(reg, rt, tmp_path):
    layout = tmp_path / "noshell"
    o.write_layout(layout, [(o.image_manifest(layout, [o.layer({"app/server": b"\x7fELF"})]), None)])
    reg.push(layout, "test/distroless:1")
    with pytest.raises(errors.InvalidInput, match="has no /bin/sh; sandboxes need a POSIX shell"):
        await rt.create(api.SandboxSpec(sandbox_id="n1", image=f"{reg.host}/test/distroless:1"))
    assert list(rt.root.iterdir()) == []


async def test_concurrent_pulls_of_one_image_download_it_once(reg, tmp_path):
    push(reg, tmp_path, "test/popular:1", o.layer({"etc/big": os.urandom(2 * 1024**2)}))
    ref = references.parse(f"{reg.host}/test/popular:1")

    class Counting(layers.Progress):
        def __init__(self) -> None:
            self.bytes = 0
            self.lock = threading.Lock()

        def advanced(self, digest: str, count: int) -> None:
            with self.lock:
                self.bytes += count

    counting = Counting()
    stores = [
        layers.LayerStore(tmp_path / "store", o.allow(reg.host)) for _ in range(6)
    ]  # as six processes would
    results = await asyncio.gather(*(asyncio.to_thread(s.pull, ref, progress=counting) for s in stores))
    assert len({r.digest for r in results}) == 1
    assert sum(r.fetched for r in results) == 2  # each layer once, by whichever pull came first
    assert counting.bytes == results[0].size


async def test_a_pull_that_takes_too_long_keeps_nothing(reg, tmp_path):
    push(reg, tmp_path, "test/slow:1", o.layer({"etc/big": os.urandom(1024**2)}))
    store = layers.LayerStore(tmp_path / "store", o.allow(reg.host), timeout=0.0)
    with pytest.raises(errors.Timeout, match="SBX_IMAGE_PULL_TIMEOUT"):
        store.pull(references.parse(f"{reg.host}/test/slow:1"))
    assert store.all() == [] and list((store.root / "blobs").iterdir()) == []


async def test_a_full_disk_is_a_clear_error_and_leaves_nothing_half_registered(reg, tmp_path):
    push(reg, tmp_path, "test/huge:1", o.layer({"etc/big": os.urandom(3 * 1024**2)}))
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(small)], check=True)
    try:
        store = layers.LayerStore(small / "store", o.allow(reg.host))
        with pytest.raises(errors.LimitExceeded, match="not enough disk space|no space left"):
            store.pull(references.parse(f"{reg.host}/test/huge:1"))
        assert store.all() == []
        assert list((store.root / "blobs").iterdir()) == []
        assert not [p for p in (store.root / "layers").iterdir() if p.name.startswith(".")]
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


async def test_prune_removes_unused_images_first_and_never_one_in_use(reg, rt, tmp_path):
    push(reg, tmp_path, "test/used:1", o.layer({"etc/u": b"1"}))
    push(reg, tmp_path, "test/unused:1", o.layer({"etc/n": b"1"}))
    used, unused = f"{reg.host}/test/used:1", f"{reg.host}/test/unused:1"
    await rt.create(api.SandboxSpec(sandbox_id="p1", image=used))
    await rt.pull(unused)
    removed, freed = rt.prune_images()
    assert [r.split("@")[0] for r in removed] == [unused] and freed > 0
    rows = {row["reference"]: row for row in rt.image_report()}
    assert rows[used]["sandboxes"] == 1 and unused not in rows
    layer_names = {p.name for p in (rt.images.pulled.root / "layers").iterdir()}
    assert len(layer_names) == 4  # busybox's layer (shared) and used's, with their records
    await rt.start("p1")
    assert (await sh(rt, "p1", "cat /etc/u"))[1] == "1"
    await rt.delete("p1")
    assert [r.split("@")[0] for r in rt.prune_images()[0]] == [used]
    assert list((rt.images.pulled.root / "layers").iterdir()) == []


def test_registries_file_parses_credentials_insecure_hosts_and_mirrors(tmp_path):
    secret = tmp_path / "token"
    secret.write_text("pw-from-file\n")
    path = tmp_path / "registries.toml"
    path.write_text(
        f"""
[registries."ghcr.io"]
username = "bot"
password_file = "{secret}"
[registries."registry.internal:5000"]
insecure = true
[registries."index.docker.io"]
mirrors = ["mirror.internal:5000"]
"""
    )
    config = RegistryConfig.load(path)
    assert config.credentials_for("ghcr.io") == ("bot", "pw-from-file")
    assert "pw-from-file" not in repr(config)
    assert config.allows_http("registry.internal:5000") and config.insecure("registry.internal", 5000)
    assert not config.insecure("registry.internal", 5001) and not config.insecure("ghcr.io", 80)
    # Loopback is no exception: only what the operator names.
    assert not config.allows_http("127.0.0.1:5000") and not config.allows_http("10.1.2.3:5000")
    assert config.names("registry.internal", 5000, "http") and config.names("ghcr.io", 443, "https")
    assert config.names("mirror.internal", 5000, "https") and config.names(
        "registry-1.docker.io", 443, "https"
    )
    assert not config.names("ghcr.io", 8443, "https") and not config.names("127.0.0.1", 5000, "http")
    assert config.mirrors_for("docker.io") == ("mirror.internal:5000",)
    for bad, said in (
        ('[registries."x"]\nusername = "a"\n', "both a username and a password"),
        ('[registries."x"]\ncolour = "red"\n', "unknown keys colour"),
        ("[other]\n", "only \\[registries"),
        ("not toml = = =", "not valid TOML"),
    ):
        path.write_text(bad)
        with pytest.raises(errors.ConfigError, match=said):
            RegistryConfig.load(path)


def test_plain_http_is_refused_for_a_registry_not_listed_as_insecure(reg, tmp_path):
    """The host's own address is not loopback: a plain-HTTP registry there is refused until
    the operator lists it as insecure."""
    address = outside_address()
    outside = o.Registry(tmp_path / "outside")
    outside.port = o.support.free_port()
    config = {
        "version": 0.1, "log": {"level": "error"},
        "storage": {"filesystem": {"rootdirectory": str(tmp_path / "outside" / "data")}},
        "http": {"addr": f"{address}:{outside.port}"},
    }  # fmt: skip
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "config.json").write_text(json.dumps(config))
    proc = subprocess.Popen(
        ["docker-registry", "serve", str(tmp_path / "outside" / "config.json")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        host = f"{address}:{outside.port}"
        for _ in range(100):
            if subprocess.run(["curl", "-sf", f"http://{host}/v2/"], capture_output=True).returncode == 0:
                break
            __import__("time").sleep(0.05)
        layout = tmp_path / "layout"
        o.simple_image(layout)
        subprocess.run(
            ["skopeo", "copy", "-q", "--dest-tls-verify=false", "--insecure-policy",
             f"oci:{layout}:latest", f"docker://{host}/t/plain:1"],
            check=True, capture_output=True,
        )  # fmt: skip
        ref = references.parse(f"{host}/t/plain:1")
        for config in (RegistryConfig(), RegistryConfig({host: Registry()})):  # unnamed; named, not insecure
            with pytest.raises(errors.Unavailable, match="cannot be reached"):
                layers.LayerStore(tmp_path / "strict", config).pull(ref)
        listed = RegistryConfig({host: Registry(insecure=True)})
        assert layers.LayerStore(tmp_path / "listed", listed).pull(ref).fetched == 1
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_operator_commands_pull_list_and_prune(reg, tmp_path):
    import sys

    from tests import support

    push(reg, tmp_path, "test/cli:1", o.layer({"etc/cli": b"1"}))
    state, ref = tmp_path / "state", f"{reg.host}/test/cli:1"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SBX_", "NATS_"))}
    env["SBX_REGISTRIES_FILE"] = str(o.registries_file(tmp_path / "registries.toml", reg.host))

    def sbx(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "sbx.cli", "image", *args, "--state-dir", str(state)],
            capture_output=True, text=True, timeout=120, cwd=support.ROOT, env=env,
        )  # fmt: skip

    pulled = sbx("pull", ref)
    assert pulled.returncode == 0, pulled.stderr
    assert f"{ref}@sha256:" in pulled.stdout and "2 layers (2 downloaded)" in pulled.stdout
    again = sbx("pull", ref)
    assert "2 layers (0 downloaded)" in again.stdout
    rows = json.loads(sbx("list", "--json").stdout)["images"]
    assert [r["kind"] for r in rows] == ["built-in", "pulled"]
    assert rows[1]["reference"] == ref and rows[1]["sandboxes"] == 0 and rows[1]["size"] > 0
    missing = sbx("pull", f"{reg.host}/test/not-there:1")
    assert missing.returncode != 0 and "has no image" in missing.stderr
    bad = sbx("pull", "Bad Ref")
    assert bad.returncode != 0 and "repository names" in bad.stderr
    pruned = sbx("prune")
    assert pruned.returncode == 0 and "1 images removed" in pruned.stdout
    assert [r["kind"] for r in json.loads(sbx("list", "--json").stdout)["images"]] == ["built-in"]


@pytest.mark.parametrize(
    "entries",
    [
        {"etc/.wh.passwd": b"", "etc/passwd": o.Link("/etc/shadow")},
        {"etc/.wh.passwd": b"", "etc/passwd": o.Link("../../../../../../etc/shadow")},
        {".wh.etc": b"", "etc": o.Link("/etc")},
        {"etc/ssl/certs/ca-certificates.crt": o.Link("/etc/shadow")},
    ],
    ids=["passwd-absolute", "passwd-relative", "etc-itself", "trust-store"],
)
async def test_an_image_cannot_make_the_host_read_its_files_for_it(reg, rt, tmp_path, entries):
    """What the runtime reads of an image on the host (its passwd, to add the sandbox user
    and find its User; whether it has a trust store) is never read through a symlink,
    which the host would resolve against its own files."""
    name = f"test/peek-{len(entries)}-{abs(hash(tuple(entries))) % 10_000}:1"
    push(reg, tmp_path, name, o.layer(entries), config={"User": "daemon"})
    image = f"{reg.host}/{name}"
    pulled = await rt.pull(image)
    record = rt.images.pulled.get(pulled.digest)
    assert record is not None and not record.trust_store
    top = rt.images.pulled.lower_dirs(record)[-1]
    shadow = Path("/etc/shadow").read_text()
    assert (top / "etc" / "passwd").read_text().splitlines() == [
        "root:x:0:0:root:/root:/bin/sh",
        "sandbox:x:1000:1000:sandbox:/home/sandbox:/bin/sh",
    ]
    assert shadow.splitlines()[0] not in (top / "etc" / "group").read_text()
    await rt.create(api.SandboxSpec(sandbox_id="peek", image=image, run_as_root=False))
    await rt.start("peek")
    code, out = await sh(rt, "peek", "cat /etc/passwd; id -u; echo $HOME")
    assert shadow.splitlines()[0].split(":")[0] + ":" not in out.replace("root:x", "").replace(
        "root:/root", ""
    )
    assert out.splitlines()[-2:] == ["1000", "/home/sandbox"]  # 'daemon' is not in the image's passwd


@pytest.fixture
def hostile():
    server = o.HostileRegistry()
    yield server
    server.stop()


def test_a_registry_that_trickles_bytes_cannot_hold_a_pull_past_its_timeout(hostile, tmp_path):
    hostile.image("slow", [o.busybox_layer()])
    hostile.trickle["slow"] = 0.05  # a manifest of some hundred bytes: tens of seconds
    store = layers.LayerStore(tmp_path / "store", o.allow(hostile.host), timeout=1.0)
    started = __import__("time").monotonic()
    with pytest.raises(errors.Timeout, match="SBX_IMAGE_PULL_TIMEOUT"):
        store.pull(references.parse(f"{hostile.host}/t/img:slow"))
    assert __import__("time").monotonic() - started < 5
    assert store.all() == []


def test_a_registry_that_trickles_its_headers_cannot_hold_a_pull_past_its_timeout(hostile, tmp_path):
    """Headers a byte every 50 ms never trip a read timeout: the pull's watchdog shuts the
    connection down at its deadline."""
    hostile.image("slowhead", [o.busybox_layer()])
    hostile.slow_heads.add("slowhead")
    store = layers.LayerStore(tmp_path / "store", o.allow(hostile.host), timeout=1.0)
    started = time.monotonic()
    with pytest.raises(errors.Timeout, match="SBX_IMAGE_PULL_TIMEOUT"):
        store.pull(references.parse(f"{hostile.host}/t/img:slowhead"))
    assert time.monotonic() - started < 10
    assert store.all() == []


def test_an_encoded_answer_is_never_inflated(hostile, tmp_path):
    """``Content-Encoding: gzip, gzip``: a few hundred bytes inflate to 64 MiB in the
    pool-manager before any cap; the puller asks for ``identity`` and reads answers as sent."""
    bomb = gzip.compress(gzip.compress(b" " * 64 * 1024**2))
    hostile.image("bomb", [o.busybox_layer()], manifest=bomb)
    hostile.encodings["bomb"] = "gzip, gzip"
    store = layers.LayerStore(tmp_path / "store", o.allow(hostile.host))
    with pytest.raises(errors.InvalidInput, match="not valid JSON"):  # (inflated: "larger than 4194304")
        store.pull(references.parse(f"{hostile.host}/t/img:bomb"))


def test_credentials_never_go_to_a_realm_a_redirect_target_names(hostile, tmp_path):
    """A registry with the operator's credentials redirects its manifest to another host
    that answers 401 with a realm of its own: nothing is sent there but the plain GET."""
    other = o.HostileRegistry()
    try:
        other.challenge = f'Bearer realm="http://{other.host}/token",service=x'
        hostile.image("away", [o.busybox_layer()])
        hostile.redirects["away"] = f"http://{other.host}/v2/t/img/manifests/away"
        config = RegistryConfig(
            {
                hostile.host: Registry(insecure=True, username="op", password="s3cret"),
                other.host: Registry(insecure=True),
            }
        )
        store = layers.LayerStore(tmp_path / "store", config)
        with pytest.raises(errors.SandboxError):
            store.pull(references.parse(f"{hostile.host}/t/img:away"))
        assert not any("/token" in seen for seen in other.seen)
        assert set(other.authorizations) == {None}
    finally:
        other.stop()


def test_entries_skipped_by_the_unpack_count_against_its_bytes(hostile, tmp_path):
    """A member of an unknown type (or a whiteout) carrying data is not written, but tarfile
    inflates its data to skip it: 64 MiB from a few KB, counted like any entry's."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        member = tarfile.TarInfo("junk")
        member.type = b"Z"
        member.size = 64 * 1024**2
        tar.addfile(member, io.BytesIO(b"\0" * member.size))
    hostile.image("skip", [gzip.compress(raw.getvalue())])
    store = layers.LayerStore(tmp_path / "store", o.allow(hostile.host), max_bytes=16 * 1024**2)
    with pytest.raises(oci.ImageError, match="SBX_IMAGE_MAX_BYTES"):
        store.pull(references.parse(f"{hostile.host}/t/img:skip"))
    assert store.all() == []


def test_layers_without_a_size_and_absurd_json_are_refused(hostile, tmp_path):
    store = layers.LayerStore(tmp_path / "store", o.allow(hostile.host))
    hostile.image("nosize", [o.busybox_layer()], sizes=False)
    with pytest.raises(oci.ImageError, match="a layer without a size"):
        store.pull(references.parse(f"{hostile.host}/t/img:nosize"))
    hostile.image("deep", [], manifest=b"[" * 200_000)
    with pytest.raises(errors.InvalidInput, match="not valid JSON"):
        store.pull(references.parse(f"{hostile.host}/t/img:deep"))
    assert store.all() == [] and list((store.root / "blobs").iterdir()) == []


def test_a_blob_redirected_to_plain_http_elsewhere_is_refused(hostile, tmp_path):
    """Even to an address the operator named (the registry's own, another port): plain HTTP
    goes only to a host:port listed as insecure."""
    address = outside_address()
    layer = o.busybox_layer()
    hostile.image("redirect", [layer])
    digest = "sha256:" + __import__("hashlib").sha256(layer).hexdigest()
    hostile.redirects[digest] = f"http://{address}:{hostile.port}/v2/t/img/blobs/{digest}"
    config = RegistryConfig({hostile.host: Registry(insecure=True), f"{address}:{hostile.port}": Registry()})
    store = layers.LayerStore(tmp_path / "store", config)
    with pytest.raises(errors.Unavailable, match="cannot be reached"):
        store.pull(references.parse(f"{hostile.host}/t/img:redirect"))
    assert sum(digest in seen for seen in hostile.seen) == registry.ATTEMPTS  # never the redirect's target
    assert store.all() == [] and list((store.root / "layers").iterdir()) == []


def test_a_tag_and_its_digest_pulled_at_once_register_one_image(reg, tmp_path, monkeypatch):
    """Two references of one manifest are pulled at once (their pull locks differ): the
    image is registered once, and a top directory sandboxes may use is never replaced."""
    digest = push(reg, tmp_path, "test/race:1", o.layer({"etc/r": os.urandom(200_000)}))
    refs = [references.parse(f"{reg.host}/test/race:1"), references.parse(f"{reg.host}/test/race@{digest}")]
    replaced: list[Path] = []
    discard = layers._discard

    def spying(path: Path) -> None:
        if path.name.endswith(".top") and not path.name.startswith(".") and path.exists():
            replaced.append(path)
        discard(path)

    monkeypatch.setattr(layers, "_discard", spying)
    for attempt in range(3):
        store = layers.LayerStore(tmp_path / f"store{attempt}", o.allow(reg.host))
        threads = [threading.Thread(target=store.pull, args=(refs[i % 2],)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(store.all()) == 1
    assert replaced == []


async def test_a_user_of_uid_zero_in_any_spelling_is_not_honoured(reg, rt, tmp_path):
    """run_as_root=false never runs as root, whatever the image's passwd calls uid 0."""
    passwd = "root:x:0:0::/root:/bin/sh\nevil:x:00:0::/root:/bin/sh\narabic:x:\u0660:0::/root:/bin/sh\n"
    for user in ("evil", "arabic", "00", "0"):
        name = f"test/zero-{user}:1"
        push(
            reg,
            tmp_path,
            name,
            o.layer({"etc/.wh.passwd": b"", "etc/passwd": passwd.encode()}),
            config={"User": user},
        )
        sid = f"z-{user}"
        await rt.create(api.SandboxSpec(sandbox_id=sid, image=f"{reg.host}/{name}", run_as_root=False))
        await rt.start(sid)
        assert (await sh(rt, sid, "id -u"))[1] == "1000\n", user


# ---- image references are an egress decision -------------------------------------------


def _unreachable(ref: str) -> str:
    return registry.UNREACHABLE.format(host=references.parse(ref).api_host)


def test_references_to_the_hosts_own_addresses_are_refused_and_all_look_alike(hostile, tmp_path, monkeypatch):
    """A tenant names host loopback ports (an HTTP service, a non-HTTP one, a closed one) in
    every notation, link-local metadata and private addresses, and a name resolving to
    loopback: nothing is connected to, and every error is the one text of a registry that
    cannot be reached (no oracle of what listens where)."""
    monkeypatch.setattr(registry, "BACKOFF", 0.0)
    raw = socket.socket()
    raw.bind(("127.0.0.1", 0))
    raw.listen(16)
    raw.setblocking(False)
    closed = o.support.free_port()
    port = hostile.port
    refs = [
        f"127.0.0.1:{port}/t/img:1",  # an HTTP service of the host
        f"127.0.0.1:{raw.getsockname()[1]}/t/img:1",  # a non-HTTP one
        f"127.0.0.1:{closed}/t/img:1",  # nothing listening
        f"localhost:{port}/t/img:1",
        f"2130706433:{port}/t/img:1",  # 127.0.0.1 in decimal
        f"[::ffff:7f00:1]:{port}/t/img:1",  # 127.0.0.1, IPv4-mapped IPv6
        f"[::1]:{port}/t/img:1",
        "169.254.169.254/latest/meta-data:1",  # cloud metadata
        "10.1.2.3:5000/t/img:1",  # private
        f"loopback.example.com:{port}/t/img:1",  # a public-looking name that resolves to loopback
        "no-such-registry.invalid/t/img:1",  # no such name
    ]

    def resolver(host: str, port: int) -> list[str]:
        return ["127.0.0.1"] if host == "loopback.example.com" else registry.resolve_addresses(host, port)

    store = layers.LayerStore(tmp_path / "store", resolver=resolver)
    for ref in refs:
        with pytest.raises(errors.SandboxError) as failed:
            store.pull(references.parse(ref))
        assert type(failed.value) is errors.Unavailable, (ref, failed.value)
        assert failed.value.message.endswith(_unreachable(ref)), (ref, failed.value.message)
    # In octal, no URL can hold it: refused from the reference's text alone.
    with pytest.raises(registry.PullError, match="is not a usable address"):
        store.pull(references.parse(f"0177.0.0.1:{port}/t/img:1"))
    assert hostile.seen == [] and hostile.connections == 0
    with pytest.raises(BlockingIOError):
        raw.accept()  # nobody connected
    raw.close()
    assert store.all() == [] and list((store.root / "layers").iterdir()) == []


@pytest.fixture
def admin():
    """A host-only HTTP endpoint (an admin API on loopback) that logs what reaches it."""
    server = o.HostileRegistry()
    yield server
    server.stop()


def test_redirects_and_token_realms_into_the_host_are_refused(hostile, admin, tmp_path, monkeypatch):
    """A registry the operator named (here on loopback; a public one alike) sends the
    puller elsewhere: every redirect and the token realm is checked like the reference.
    A GET of the attacker's choice never reaches the host-only endpoint."""
    monkeypatch.setattr(registry, "BACKOFF", 0.0)
    good = o.HostileRegistry()  # another named registry: redirects to it are followed
    try:
        good.image("ok", [o.busybox_layer()])
        hostile.image("ok", [o.busybox_layer()])
        hostile.redirects["ok"] = f"http://{good.host}/v2/t/img/manifests/ok"
        targets = {
            "plain": f"http://127.0.0.1:{admin.port}/admin/delete?all=1",
            "tls": f"https://127.0.0.1:{admin.port}/admin/delete?all=1",
            "mapped": f"https://[::ffff:127.0.0.1]:{admin.port}/admin",
            "localhost": f"http://localhost:{admin.port}/admin",
            "metadata": "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
            "named-metadata": "https://metadata.example.com/computeMetadata/v1/",
            "loop": f"http://{hostile.host}/v2/t/img/manifests/loop",
        }
        hostile.redirects.update(targets)

        def resolver(host: str, port: int) -> list[str]:
            if host == "metadata.example.com":
                return ["169.254.169.254"]
            return registry.resolve_addresses(host, port)

        config = o.allow(hostile.host, good.host)
        store = layers.LayerStore(tmp_path / "store", config, resolver=resolver)
        assert store.pull(references.parse(f"{hostile.host}/t/img:ok")).fetched == 1  # followed
        for tag in targets:
            ref = f"{hostile.host}/t/img:{tag}"
            with pytest.raises(errors.Unavailable) as failed:
                store.pull(references.parse(ref))
            assert failed.value.message.endswith(_unreachable(ref)), (tag, failed.value.message)
        loops = sum(seen.endswith("/manifests/loop") for seen in hostile.seen)
        assert loops == registry.ATTEMPTS * (registry.MAX_REDIRECTS + 1)  # bounded
        hostile.redirects.clear()
        for realm in (
            f"http://127.0.0.1:{admin.port}/admin?cmd=drop-everything",
            f"https://127.0.0.1:{admin.port}/token",
            "https://metadata.example.com/token",
        ):
            hostile.challenge = f'Bearer realm="{realm}",service="registry"'
            with pytest.raises(errors.Unavailable) as failed:
                store.pull(references.parse(f"{hostile.host}/t/img:realm"))
            assert failed.value.message.endswith(_unreachable(f"{hostile.host}/t/img:realm")), realm
        assert admin.seen == [] and admin.connections == 0
    finally:
        good.stop()


def test_the_connection_goes_to_the_address_that_was_checked(hostile, tmp_path, monkeypatch):
    """No second lookup between the check and the connection (DNS rebinding): the
    resolver is asked once per hop, and the connection is made to its answer; the system's
    resolver, which would answer otherwise, is never asked for the name."""
    hostile.image("pinned", [o.busybox_layer()])
    real = socket.getaddrinfo
    asked: list[str] = []

    def system_resolver(host, *args, **kwargs):
        asked.append(str(host))
        if host == "pinned.example.com":
            raise socket.gaierror(socket.EAI_NONAME, "rebound elsewhere")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", system_resolver)
    checked: list[str] = []

    def resolver(host: str, port: int) -> list[str]:
        checked.append(host)
        return ["127.0.0.1"]

    name = f"pinned.example.com:{hostile.port}"
    store = layers.LayerStore(tmp_path / "store", o.allow(name), resolver=resolver)
    assert store.pull(references.parse(f"{name}/t/img:pinned")).fetched == 1
    assert checked and set(checked) == {"pinned.example.com"}
    assert "pinned.example.com" not in asked


# ---- disk: the manifest's size, and free bytes and inodes while writing ---------------------


@pytest.fixture
def small_fs(tmp_path):
    """A 64 MiB ext4 filesystem of 2048 inodes, loop-mounted (the machine's disk is never
    filled), and a thread noting the least it had free while a test ran."""
    image, mount = tmp_path / "fs.img", tmp_path / "fs"
    subprocess.run(["truncate", "-s", "64M", str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", "-N", "2048", str(image)], check=True)
    mount.mkdir()
    subprocess.run(["mount", "-o", "loop", str(image), str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


class Lowest:
    """The least free bytes and inodes a filesystem had while this ran (sampled)."""

    def __init__(self, path: Path) -> None:
        self.path, self.bytes, self.inodes = path, 2**63, 2**63
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            st = os.statvfs(self.path)
            self.bytes = min(self.bytes, st.f_bavail * st.f_frsize)
            self.inodes = min(self.inodes, st.f_favail)
            self._stop.wait(0.002)

    def __enter__(self) -> Lowest:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _nothing_kept(store: layers.LayerStore) -> None:
    assert store.all() == []
    for sub in ("layers", "manifests", "tags", "blobs"):
        assert list((store.root / sub).iterdir()) == [], sub


async def test_pulls_keep_the_reserve_of_bytes_and_inodes_and_keep_nothing_when_refused(
    reg, small_fs, tmp_path
):
    reserve, inodes = 24 * 1024**2, 600
    zeros = o.layer({"zeros": b"\0" * (96 * 1024**2)}, compress=False)
    bomb = gzip.compress(zeros, 9)
    many = o.layer({f"f{n}": b"" for n in range(3000)})
    assert len(bomb) < 256 * 1024 and len(many) < 256 * 1024  # small downloads
    push(reg, tmp_path, "test/disk-bomb:1", bomb)
    push(reg, tmp_path, "test/inode-bomb:1", many)
    st = os.statvfs(small_fs)
    assert st.f_bavail * st.f_frsize > reserve + 2 * len(bomb) and st.f_favail > inodes + 100
    store = layers.LayerStore(small_fs / "store", o.allow(reg.host), reserve=reserve, reserve_inodes=inodes)
    for name, said in (("disk-bomb", "MiB free"), ("inode-bomb", "inodes free")):
        with Lowest(small_fs) as lowest, pytest.raises(errors.LimitExceeded, match=said) as refused:
            store.pull(references.parse(f"{reg.host}/test/{name}:1"))
        assert "nothing was kept" in refused.value.message
        assert lowest.bytes >= reserve and lowest.inodes >= inodes, (name, lowest.bytes, lowest.inodes)
        _nothing_kept(store)  # not even the busybox layer this pull unpacked
    # With room, the same store pulls an image as usual.
    push(reg, tmp_path, "test/fits:1", o.layer({"etc/fits": b"1"}))
    assert store.pull(references.parse(f"{reg.host}/test/fits:1")).fetched == 2


async def test_an_image_of_too_many_layers_is_refused_before_any_blob_is_asked_for(reg, tmp_path):
    one = o.layer({"etc/one": b"1"})
    reg.put_image("test/many-layers", "1", [one] * 600)
    store = layers.LayerStore(tmp_path / "store", o.allow(reg.host))
    with pytest.raises(
        oci.ImageError, match="has 600 layers, more than the limit of 128 .*SBX_IMAGE_MAX_LAYERS"
    ):
        store.pull(references.parse(f"{reg.host}/test/many-layers:1"))
    await o.support.eventually(lambda: reg.requests("GET", "test/many-layers/manifests/"), timeout=5)
    assert reg.requests("GET", "test/many-layers/blobs/") == []
    _nothing_kept(store)


# ---- layers are tenant-safe -------------------------------------------------------------


async def test_a_shared_layer_never_takes_its_files_from_another_images_layers(reg, tmp_path):
    """Two organisations' images share an upper layer (same digest) whose unpacked form
    reads the layers below it: a hard link to a lower file and a directory it implies.
    The first to pull must not decide what the second's image shows."""
    shared = o.layer({"opt/linked": o.Link("opt/secret", hard=True), "opt/added": b"shared\n"})
    bases = {
        "a": o.layer({"opt": o.Dir(0o777), "opt/secret": b"organisation A\n"}),
        "b": o.layer({"opt": o.Dir(0o750), "opt/secret": b"organisation B\n"}),
    }
    for org, base in bases.items():
        push(reg, tmp_path, f"test/tenant-{org}:1", base, shared)
    store = layers.LayerStore(tmp_path / "store", o.allow(reg.host))
    pulled = {org: store.pull(references.parse(f"{reg.host}/test/tenant-{org}:1")) for org in bases}
    for org, mode in (("a", 0o777), ("b", 0o750)):
        lowers = list(reversed(store.lower_dirs(pulled[org])))
        assert layers.read_image_file(lowers, "opt/linked") == f"organisation {org.upper()}\n"
        finder = layerfs.LayerExtractor("", oci.Budget(0, 0), [str(p) for p in lowers])
        found = finder.find("opt")
        assert found is not None and stat.S_IMODE(found[1].st_mode) == mode | oci.DIR_OWNER, org
    assert pulled["a"].dirs[-1] != pulled["b"].dirs[-1]  # one directory per stack
