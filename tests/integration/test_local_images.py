"""Images on the local runtime: a root filesystem directory and a `docker save` archive,
registered by name and started as real sandboxes (no network, no registry)."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from sbx_api import errors
from shared.runtime import api
from shared.runtime.local import runtime as local

pytestmark = pytest.mark.needs_root("the local runtime needs root")


def minimal_rootfs(dest: Path) -> Path:
    """dash and the C library copied from the host: the smallest image that runs `sh`."""
    dash = Path(shutil.which("dash") or "/bin/dash").resolve()
    (dest / "bin").mkdir(parents=True)
    shutil.copy2(dash, dest / "bin" / "sh")
    libs = subprocess.run(["ldd", str(dash)], capture_output=True, text=True, check=True).stdout
    for line in libs.splitlines():
        path = next((p for p in line.split() if p.startswith("/")), None)
        if path:
            target = dest / path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(Path(path).resolve(), target)
    (dest / "etc").mkdir()
    (dest / "etc" / "image-name").write_text("minimal\n")
    for d in ("proc", "dev", "tmp", "sys"):
        (dest / d).mkdir(exist_ok=True)
    return dest


def docker_save(rootfs: Path, archive: Path) -> None:
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        tar.add(rootfs, arcname=".")
    config = json.dumps({"config": {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh"]}}).encode()
    manifest = json.dumps(
        [{"Config": "config.json", "RepoTags": ["minimal:1"], "Layers": ["l1/layer.tar"]}]
    ).encode()
    with tarfile.open(archive, "w") as tar:
        for name, data in (
            ("manifest.json", manifest),
            ("config.json", config),
            ("l1/layer.tar", layer.getvalue()),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.fixture
async def rt(tmp_path):
    runtime = local.LocalRuntime(tmp_path / "state")
    yield runtime
    for info in await runtime.list():
        await runtime.delete(info.sandbox_id)


async def test_a_registered_rootfs_and_an_imported_archive_run(rt, tmp_path):
    rootfs = minimal_rootfs(tmp_path / "rootfs")
    rt.images.add_rootfs("minimal", rootfs)
    docker_save(rootfs, tmp_path / "image.tar")
    rt.images.import_archive("imported", tmp_path / "image.tar")
    assert rt.images.names() == ["imported", "minimal"]
    for image in ("minimal", "imported"):
        spec = api.SandboxSpec(sandbox_id=f"img-{image}", image=image)
        await rt.create(spec)
        await rt.start(spec.sandbox_id)
        result, out, err = await rt.run(
            spec.sandbox_id, ["/bin/sh", "-c", "read n < /etc/image-name; echo $n; echo ok > /workspace/f"]
        )
        assert (result.exit_code, out) == (0, b"minimal\n"), err
        # Copy-on-write root: changes stay in this sandbox, the image is untouched.
        await rt.run(spec.sandbox_id, ["/bin/sh", "-c", "echo changed > /etc/image-name"])
    assert (rootfs / "etc" / "image-name").read_text() == "minimal\n"


async def test_bad_images_are_refused_clearly(rt, tmp_path):
    with pytest.raises(errors.InvalidInput, match="bin/sh"):
        rt.images.add_rootfs(
            "empty", (tmp_path / "empty").resolve() if (tmp_path / "empty").mkdir() is None else tmp_path
        )
    with pytest.raises(
        errors.Unavailable, match=r"pulling 127.0.0.1:1/ghost:latest: registry 127.0.0.1:1 cannot be"
    ):
        await rt.create(api.SandboxSpec(sandbox_id="x1", image="127.0.0.1:1/ghost"))
    assert not list(rt.root.iterdir())  # nothing written
    with pytest.raises(errors.InvalidInput):
        rt.images.add_rootfs("Bad Name", tmp_path)
