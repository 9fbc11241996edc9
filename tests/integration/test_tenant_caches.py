"""Per-tenant package caches on the real local runtime: real bubblewrap sandboxes, real
mounts. Sandboxes of one organisation share a cache; another organisation's sandboxes
and sandboxes without one never see it; deleting a sandbox never touches a cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sbx_api import errors
from shared.contract import ids
from shared.runtime import api
from shared.runtime.local import caches, mounts, sandboxdirs
from shared.runtime.local import runtime as local

pytestmark = pytest.mark.needs_root("the local runtime and mounts need root")
ACME, GLOBEX = ids.token("acme"), ids.token("globex")


@pytest.fixture
async def runtime(tmp_path):
    rt = local.LocalRuntime(tmp_path / "state")
    yield rt
    for info in await rt.list():
        await rt.delete(info.sandbox_id)
    for cache in rt.caches.caches.iterdir() if rt.caches.caches.exists() else ():
        while caches.mounted_on(cache):  # each cache's own nosuid bind: not left on the machine
            caches._libc.umount2(bytes(cache), caches.MNT_DETACH)


async def started(rt: local.LocalRuntime, name: str, *, run_as_root: bool = True) -> str:
    await rt.create(api.SandboxSpec(sandbox_id=name, run_as_root=run_as_root))
    await rt.start(name)
    return name


async def sh(rt: local.LocalRuntime, sandbox: str, script: str) -> tuple[int, str]:
    result, out, err = await rt.run(sandbox, ["/bin/sh", "-c", script], timeout=30)
    return result.exit_code, (out + err).decode()


async def test_one_organisation_shares_a_cache_and_no_other_sees_it(runtime, tmp_path):
    a1 = await started(runtime, "acme-1")
    a2 = await started(runtime, "acme-2", run_as_root=False)
    g1 = await started(runtime, "globex-1")
    lone = await started(runtime, "no-org-1")
    assert await runtime.attach_cache(a1, ACME) is True
    assert await runtime.attach_cache(a1, ACME) is False  # idempotent
    assert await runtime.attach_cache(a2, ACME) is True
    assert await runtime.attach_cache(g1, GLOBEX) is True

    code, out = await sh(
        runtime,
        a1,
        'mkdir -p "$PIP_CACHE_DIR" && echo wheel > "$PIP_CACHE_DIR/pkg.whl"; echo $XDG_CACHE_HOME',
    )
    assert code == 0 and out.strip() == caches.CACHE_DIR
    assert await sh(runtime, a2, f"cat {caches.CACHE_DIR}/pip/pkg.whl") == (0, "wheel\n")
    code, out = await sh(runtime, g1, f"ls -A {caches.CACHE_DIR}; cat {caches.CACHE_DIR}/pip/pkg.whl")
    assert code != 0 and "wheel" not in out
    code, out = await sh(runtime, lone, f"echo mine > {caches.CACHE_DIR}/x && ls -A {caches.CACHE_DIR}")
    assert (code, out) == (0, "x\n")  # a cache of its own

    # Another organisation's cache can never be attached to a sandbox that shows one.
    with pytest.raises(errors.Conflict):
        await runtime.attach_cache(a1, GLOBEX)
    with pytest.raises(errors.InvalidInput):
        await runtime.attach_cache(a1, "../../etc")

    # Deleting sandboxes detaches, never deletes: the cache outlives them.
    for sandbox in (a1, a2, g1, lone):
        await runtime.delete(sandbox)
    cache = tmp_path / "state" / "caches" / ACME
    assert (cache / "pip" / "pkg.whl").read_text() == "wheel\n"
    assert not [p for p in (tmp_path / "state" / "cache-slots").iterdir() if not p.name.startswith(".")]
    assert caches.mounted_on(cache) == 1  # its own nosuid,nodev bind; no sandbox's slot any more
    assert not caches.mounted_under(tmp_path / "state" / "cache-slots")


async def test_a_stopped_sandbox_holds_no_mount_or_cgroup_and_starts_as_it_was(runtime, tmp_path):
    """Stopped, a sandbox holds nothing of the host (its state dir can be removed once it is
    deleted); started again, it has its files and its organisation's cache back."""
    limits = api.Limits(disk_bytes=64 * 1024**2, disk_inodes=4096)  # a filesystem of its own
    await runtime.create(api.SandboxSpec(sandbox_id="acme-stop", limits=limits))
    sandbox = (await runtime.start("acme-stop")).sandbox_id
    # Its filesystem is mounted in its own namespace, never in the host's mount table.
    assert not os.path.ismount(runtime.dirs.dir(sandbox) / "rw")
    assert not caches.mounted_under(Path(os.path.realpath(runtime.dirs.dir(sandbox))))
    assert await sh(runtime, sandbox, "df -k /workspace | tail -1 | awk '{print ($2 < 70000)}'") == (0, "1\n")
    assert await runtime.attach_cache(sandbox, ACME) is True
    assert await sh(runtime, sandbox, f"echo kept > /workspace/f && echo w > {caches.CACHE_DIR}/w") == (0, "")
    sandbox_dir = runtime.dirs.dir(sandbox)
    await runtime.stop(sandbox)

    state = Path(os.path.realpath(tmp_path / "state"))
    assert not caches.mounted_under(Path(os.path.realpath(sandbox_dir)))
    assert not caches.mounted_under(state / "cache-slots")
    assert not any(d.exists() for d in runtime.cgroups.dirs(sandboxdirs.cgroup_name(sandbox)))
    assert (await runtime.get(sandbox)).status == "stopped"

    await runtime.start(sandbox)
    assert await sh(runtime, sandbox, f"cat /workspace/f {caches.CACHE_DIR}/w") == (0, "kept\nw\n")
    # Still that organisation's: another one's is refused as before.
    with pytest.raises(errors.Conflict):
        await runtime.attach_cache(sandbox, GLOBEX)


async def test_a_sandbox_cannot_escape_its_cache_by_links(runtime, tmp_path):
    """A link planted in the shared cache points inside the sandbox that follows it, never
    at the host: the cache is just a directory to every sandbox."""
    a1 = await started(runtime, "acme-1")
    a2 = await started(runtime, "acme-2")
    await runtime.attach_cache(a1, ACME)
    await runtime.attach_cache(a2, ACME)
    (tmp_path / "host-secret").write_text("host secret\n")
    await sh(runtime, a1, f"ln -s {tmp_path}/host-secret {caches.CACHE_DIR}/link")
    code, out = await sh(runtime, a2, f"cat {caches.CACHE_DIR}/link")
    assert "host secret" not in out


async def test_a_restarted_sandbox_keeps_its_slot(runtime):
    a1 = await started(runtime, "acme-1")
    await runtime.attach_cache(a1, ACME)
    await sh(runtime, a1, f"echo kept > {caches.CACHE_DIR}/k")
    await runtime.stop(a1)
    await runtime.start(a1)
    assert await sh(runtime, a1, f"cat {caches.CACHE_DIR}/k") == (0, "kept\n")


async def test_a_cache_is_private_to_root_and_never_honours_setuid(runtime, tmp_path):
    """A root sandbox can write a setuid file into its cache; on the host it sits under
    directories only root can enter, on mounts that ignore setuid and device files."""
    a1 = await started(runtime, "acme-1")
    await runtime.attach_cache(a1, ACME)
    code, out = await sh(
        runtime, a1, f"cp /bin/true {caches.CACHE_DIR}/t && chmod 4755 {caches.CACHE_DIR}/t && "
        f"grep ' {caches.CACHE_DIR} ' /proc/self/mountinfo"
    )  # fmt: skip
    assert code == 0 and "nosuid" in out and "nodev" in out
    state = tmp_path / "state"
    for directory in (state / "caches", state / "cache-slots", state / "caches" / ACME):
        assert directory.stat().st_mode & 0o777 == 0o700


async def test_deleting_a_sandbox_while_its_cache_is_attached_never_empties_the_cache(runtime, tmp_path):
    """attach and release take the slot's lock: whichever comes second sees the other's
    result, and a slot is removed only when nothing is mounted on or below it."""
    import asyncio

    for round_ in range(5):
        name = await started(runtime, f"race-{round_}")
        await sh(runtime, name, "true")
        (tmp_path / "state" / "caches").mkdir(exist_ok=True, mode=0o700)
        results = await asyncio.gather(
            runtime.attach_cache(name, ACME), runtime.delete(name), return_exceptions=True
        )
        assert all(r is None or isinstance(r, bool | errors.NotRunning | errors.NotFound) for r in results), (
            results
        )
    keep = await started(runtime, "keeper")
    await runtime.attach_cache(keep, ACME)
    await sh(runtime, keep, f"echo precious > {caches.CACHE_DIR}/p")
    doomed = await started(runtime, "doomed")
    await asyncio.gather(runtime.attach_cache(doomed, ACME), runtime.delete(doomed), return_exceptions=True)
    assert (tmp_path / "state" / "caches" / ACME / "p").read_text() == "precious\n"


async def test_a_sandbox_made_for_an_organisation_shows_its_cache_from_the_start(runtime):
    """An organisation's pool sandbox (``SandboxSpec.cache``): the cache is there before
    any session has it, and it can never be given another organisation's."""
    a1 = await started(runtime, "acme-1")
    assert await runtime.attach_cache(a1, ACME) is True
    assert (await sh(runtime, a1, f"echo warm > {caches.CACHE_DIR}/marker"))[0] == 0
    await runtime.create(api.SandboxSpec(sandbox_id="acme-pool-1", cache=ACME))
    await runtime.start("acme-pool-1")
    assert await sh(runtime, "acme-pool-1", f"cat {caches.CACHE_DIR}/marker") == (0, "warm\n")
    assert await runtime.attach_cache("acme-pool-1", ACME) is False
    with pytest.raises(errors.Conflict):
        await runtime.attach_cache("acme-pool-1", GLOBEX)


async def test_sandboxes_and_their_caches_add_no_mount_to_the_host(runtime, tmp_path):
    """Every host mount makes every later start slower (bubblewrap reads the host's mount
    table once per bind): a sandbox, its slot and an attached cache add none; an
    organisation's cache is bound onto itself once, whatever the number of sandboxes."""
    state = Path(os.path.realpath(tmp_path / "state"))
    first = await started(runtime, "acme-0")
    assert await runtime.attach_cache(first, ACME) is True
    assert mounts.mounts_under(state) == [state / "caches" / ACME]
    for n in range(1, 4):
        sandbox = await started(runtime, f"acme-{n}", run_as_root=n % 2 == 0)
        assert await runtime.attach_cache(sandbox, ACME) is True
        assert await sh(runtime, sandbox, f"echo {n} > {caches.CACHE_DIR}/{n}") == (0, "")
    await runtime.create(api.SandboxSpec(sandbox_id="acme-pool", cache=ACME))
    await runtime.start("acme-pool")
    await started(runtime, "no-org")
    assert mounts.mounts_under(state) == [state / "caches" / ACME]
    assert await sh(runtime, "acme-pool", f"cat {caches.CACHE_DIR}/1 {caches.CACHE_DIR}/2") == (0, "1\n2\n")
    code, out = await sh(runtime, "no-org", f"ls -A {caches.CACHE_DIR}")
    assert (code, out) == (0, "")


async def test_a_cache_attached_to_a_stopped_sandbox_shows_from_its_next_start(runtime):
    await started(runtime, "acme-later")
    await runtime.stop("acme-later")
    assert await runtime.attach_cache("acme-later", ACME) is True
    assert await runtime.attach_cache("acme-later", ACME) is False
    with pytest.raises(errors.Conflict):
        await runtime.attach_cache("acme-later", GLOBEX)
    keeper = await started(runtime, "acme-keeper")
    await runtime.attach_cache(keeper, ACME)
    await sh(runtime, keeper, f"echo shared > {caches.CACHE_DIR}/s")
    await runtime.start("acme-later")
    assert await sh(runtime, "acme-later", f"cat {caches.CACHE_DIR}/s") == (0, "shared\n")
