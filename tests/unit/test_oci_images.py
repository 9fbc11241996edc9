"""Unpacking untrusted image archives (shared.runtime.local.oci) into a rootfs.

Every archive is built here in ``tmp_path``: no docker, no network.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sbx_api import errors
from shared.runtime.local import oci

# ---- archive builders -----------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    name: str
    kind: bytes = tarfile.REGTYPE
    data: bytes = b""
    mode: int = 0o644
    link: str = ""


def file(name: str, data: bytes = b"", mode: int = 0o644) -> Entry:
    return Entry(name, tarfile.REGTYPE, data, mode)


def directory(name: str, mode: int = 0o755) -> Entry:
    return Entry(name, tarfile.DIRTYPE, mode=mode)


def symlink(name: str, target: str) -> Entry:
    return Entry(name, tarfile.SYMTYPE, mode=0o777, link=target)


def hardlink(name: str, target: str) -> Entry:
    return Entry(name, tarfile.LNKTYPE, link=target)


def special(name: str, kind: bytes) -> Entry:
    return Entry(name, kind, mode=0o666)


def layer(*entries: Entry, compress: bool = False) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in entries:
            info = tarfile.TarInfo(entry.name)
            info.type = entry.kind
            info.mode = entry.mode
            info.mtime = 1_700_000_000
            info.linkname = entry.link
            if entry.kind in (tarfile.CHRTYPE, tarfile.BLKTYPE):
                info.devmajor, info.devminor = 1, 3
            if entry.kind == tarfile.REGTYPE:
                info.size = len(entry.data)
                tar.addfile(info, io.BytesIO(entry.data))
            else:
                tar.addfile(info)
    data = buffer.getvalue()
    return gzip.compress(data, mtime=0) if compress else data


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_tar(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


CONFIG = {
    "architecture": "amd64",
    "os": "linux",
    "config": {
        "Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8"],
        "Cmd": ["bash", "-l"],
        "Entrypoint": ["/entry.sh"],
        "WorkingDir": "/work",
        "User": "1000:1000",
    },
    "rootfs": {"type": "layers", "diff_ids": []},
}


def docker_save(path: Path, layers: list[bytes], config: dict | None = None, *, blobs: bool = False) -> Path:
    """A ``docker save`` archive: legacy ``<id>/layer.tar`` or (``blobs``) Docker 25+ blob names."""
    config_bytes = json.dumps(CONFIG if config is None else config).encode()
    files: dict[str, bytes] = {}
    names = []
    for index, data in enumerate(layers):
        name = f"blobs/sha256/{sha256(data)}" if blobs else f"{index:064x}/layer.tar"
        files[name] = data
        names.append(name)
    config_name = f"blobs/sha256/{sha256(config_bytes)}" if blobs else f"{sha256(config_bytes)}.json"
    files[config_name] = config_bytes
    manifest = [{"Config": config_name, "RepoTags": ["demo:latest"], "Layers": names}]
    files["manifest.json"] = json.dumps(manifest).encode()
    return write_tar(path, files)


LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
INDEX = "application/vnd.oci.image.index.v1+json"


def oci_layout(
    layers: list[tuple[str, bytes]],
    config: dict | None = None,
    *,
    nested: bool = True,
    tamper: bytes | None = None,
) -> dict[str, bytes]:
    """Files of an OCI layout: index.json -> (image index) -> manifest -> config + layers.

    ``tamper`` replaces the first layer's blob content after its digest was recorded.
    """
    blobs: dict[str, bytes] = {}

    def add(data: bytes, media_type: str, **extra: object) -> dict:
        blobs[f"blobs/sha256/{sha256(data)}"] = data
        return {"mediaType": media_type, "digest": f"sha256:{sha256(data)}", "size": len(data), **extra}

    config_desc = add(
        json.dumps(CONFIG if config is None else config).encode(), "application/vnd.oci.image.config.v1+json"
    )
    layer_descs = [add(data, media_type) for media_type, data in layers]
    if tamper is not None:
        blobs[f"blobs/sha256/{layer_descs[0]['digest'].split(':')[1]}"] = tamper
    manifest = {"schemaVersion": 2, "mediaType": MANIFEST, "config": config_desc, "layers": layer_descs}
    amd64 = {"architecture": "amd64", "os": "linux"}
    manifest_desc = add(json.dumps(manifest).encode(), MANIFEST, platform=amd64)
    if nested:
        attestation = add(b"{}", MANIFEST, platform={"architecture": "unknown", "os": "unknown"})
        image_index = {"schemaVersion": 2, "mediaType": INDEX, "manifests": [attestation, manifest_desc]}
        top = add(json.dumps(image_index).encode(), INDEX)
    else:
        top = manifest_desc
    return {
        "oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
        "index.json": json.dumps({"schemaVersion": 2, "manifests": [top]}).encode(),
        **blobs,
    }


def oci_tar(path: Path, layers: list[tuple[str, bytes]], **options: Any) -> Path:
    return write_tar(path, oci_layout(layers, **options))


@pytest.fixture
def rootfs(tmp_path: Path) -> Path:
    return tmp_path / "images" / "demo" / "rootfs"


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    path = tmp_path / "outside-dir"
    path.mkdir()
    (path / "victim").write_text("host data")
    return path


def assert_rejected(archive: Path, rootfs: Path, **limits: int) -> oci.ImageError:
    with pytest.raises(oci.ImageError) as caught:
        oci.unpack(archive, rootfs, **limits)
    assert not rootfs.exists(), "a failed unpack must remove the partial rootfs"
    return caught.value


# ---- formats --------------------------------------------------------------------


def test_docker_save_layers_apply_in_order_with_whiteouts(tmp_path: Path, rootfs: Path) -> None:
    base = layer(
        directory("etc"),
        file("etc/keep", b"kept"),
        file("etc/gone", b"deleted by layer 2"),
        directory("etc/gonedir"),
        file("etc/gonedir/inner", b"x"),
        file("etc/replaced", b"old"),
        directory("opt"),
        file("opt/old", b"from layer 1"),
        directory("opt/sub"),
        file("opt/sub/deep", b"from layer 1"),
    )
    top = layer(
        file("etc/.wh.gone"),
        file("etc/.wh.gonedir"),
        file("etc/replaced", b"new"),
        directory("opt"),
        file("opt/new", b"from layer 2"),  # written before the opaque marker: must survive it
        file("opt/.wh..wh..opq"),
        directory("opt/sub"),
        file("opt/sub/fresh", b"from layer 2"),
    )
    config = oci.unpack(docker_save(tmp_path / "image.tar", [base, top]), rootfs)

    assert config.cmd == ["bash", "-l"]
    assert (rootfs / "etc/keep").read_bytes() == b"kept"
    assert not (rootfs / "etc/gone").exists()
    assert not (rootfs / "etc/gonedir").exists()
    assert not (rootfs / "etc/.wh.gone").exists()
    assert (rootfs / "etc/replaced").read_bytes() == b"new"
    assert sorted(p.name for p in (rootfs / "opt").iterdir()) == ["new", "sub"]
    assert sorted(p.name for p in (rootfs / "opt/sub").iterdir()) == ["fresh"]
    assert not (rootfs / "opt/.wh..wh..opq").exists()


def test_docker_save_gzip_layer(tmp_path: Path, rootfs: Path) -> None:
    archive = docker_save(tmp_path / "image.tar", [layer(file("hello.txt", b"hi"), compress=True)])
    oci.unpack(archive, rootfs)
    assert (rootfs / "hello.txt").read_bytes() == b"hi"


def test_docker_save_blob_layers_are_verified(tmp_path: Path, rootfs: Path) -> None:
    good = docker_save(tmp_path / "good.tar", [layer(file("a", b"a"))], blobs=True)
    oci.unpack(good, rootfs)
    assert (rootfs / "a").read_bytes() == b"a"

    data = layer(file("a", b"a"))
    bad = write_tar(
        tmp_path / "bad.tar",
        {
            f"blobs/sha256/{sha256(data)}": layer(file("a", b"evil")),
            "cfg.json": json.dumps(CONFIG).encode(),
            "manifest.json": json.dumps(
                [{"Config": "cfg.json", "Layers": [f"blobs/sha256/{sha256(data)}"]}]
            ).encode(),
        },
    )
    error = assert_rejected(bad, tmp_path / "other")
    assert "digest mismatch" in str(error)


def test_docker_save_layer_symlink_inside_the_archive(tmp_path: Path, rootfs: Path) -> None:
    """Docker 25+ writes ``<id>/layer.tar`` as a symlink to the blob."""
    data = layer(file("via-link", b"ok"))
    archive = tmp_path / "image.tar"
    with tarfile.open(archive, "w") as tar:
        for name, payload in {
            f"blobs/sha256/{sha256(data)}": data,
            "cfg.json": json.dumps(CONFIG).encode(),
            "manifest.json": json.dumps([{"Config": "cfg.json", "Layers": ["abc/layer.tar"]}]).encode(),
        }.items():
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
        link = tarfile.TarInfo("abc/layer.tar")
        link.type = tarfile.SYMTYPE
        link.linkname = f"../blobs/sha256/{sha256(data)}"
        tar.addfile(link)
    oci.unpack(archive, rootfs)
    assert (rootfs / "via-link").read_bytes() == b"ok"


def test_oci_layout_tar_with_nested_index_and_gzip_layers(tmp_path: Path, rootfs: Path) -> None:
    layers = [
        (LAYER_GZIP, layer(directory("usr"), file("usr/one", b"1"), file("usr/two", b"2"), compress=True)),
        (LAYER_GZIP, layer(file("usr/.wh.one"), file("usr/three", b"3"), compress=True)),
        (LAYER_TAR, layer(file("plain", b"p"))),
    ]
    config = oci.unpack(oci_tar(tmp_path / "oci.tar", layers), rootfs)
    assert config.entrypoint == ["/entry.sh"]
    assert sorted(p.name for p in (rootfs / "usr").iterdir()) == ["three", "two"]
    assert (rootfs / "plain").read_bytes() == b"p"


def test_oci_layout_directory_with_direct_manifest(tmp_path: Path, rootfs: Path) -> None:
    layout = tmp_path / "layout"
    for name, data in oci_layout([(LAYER_GZIP, layer(file("x", b"x"), compress=True))], nested=False).items():
        (layout / name).parent.mkdir(parents=True, exist_ok=True)
        (layout / name).write_bytes(data)
    oci.unpack(layout, rootfs)
    assert (rootfs / "x").read_bytes() == b"x"


def test_oci_digest_mismatch_is_rejected(tmp_path: Path, rootfs: Path) -> None:
    layers = [(LAYER_GZIP, layer(file("x", b"x"), compress=True))]
    archive = oci_tar(tmp_path / "oci.tar", layers, tamper=layer(file("x", b"evil"), compress=True))
    error = assert_rejected(archive, rootfs)
    assert "digest mismatch" in str(error)
    assert isinstance(error, errors.InvalidInput)


def test_zstd_layers_are_refused_clearly(tmp_path: Path, rootfs: Path) -> None:
    archive = oci_tar(
        tmp_path / "oci.tar", [("application/vnd.oci.image.layer.v1.tar+zstd", b"\x28\xb5\x2f\xfd")]
    )
    error = assert_rejected(archive, rootfs)
    assert str(error) == "zstd layers are not supported"


def test_not_an_image(tmp_path: Path, rootfs: Path) -> None:
    assert_rejected(write_tar(tmp_path / "x.tar", {"hello": b"world"}), rootfs)
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"not a tar at all" * 100)
    assert_rejected(junk, rootfs)
    assert_rejected(tmp_path / "missing.tar", rootfs)


# ---- config -----------------------------------------------------------------------


def test_config_fields_are_parsed(tmp_path: Path, rootfs: Path) -> None:
    config = oci.unpack(docker_save(tmp_path / "image.tar", [layer(file("a"))]), rootfs)
    assert config == oci.ImageConfig(
        env=["PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8"],
        cmd=["bash", "-l"],
        entrypoint=["/entry.sh"],
        working_dir="/work",
        user="1000:1000",
    )


@pytest.mark.parametrize("document", [{}, {"config": None}, {"config": {"WorkingDir": "", "User": ""}}])
def test_missing_config_fields_default(tmp_path: Path, rootfs: Path, document: dict) -> None:
    config = oci.unpack(docker_save(tmp_path / "image.tar", [layer(file("a"))], document), rootfs)
    assert config == oci.ImageConfig(env=[], cmd=None, entrypoint=None, working_dir=None, user=None)


def test_malformed_config_is_rejected(tmp_path: Path, rootfs: Path) -> None:
    archive = docker_save(tmp_path / "image.tar", [layer(file("a"))], {"config": {"Cmd": "not a list"}})
    assert_rejected(archive, rootfs)


# ---- rootfs shape ---------------------------------------------------------------------


def test_mount_points_exist(tmp_path: Path, rootfs: Path) -> None:
    oci.unpack(docker_save(tmp_path / "image.tar", [layer(file("a"))]), rootfs)
    for name in ("proc", "dev", "tmp", "sys"):
        assert (rootfs / name).is_dir() and not (rootfs / name).is_symlink()
    assert (rootfs / "tmp").stat().st_mode & stat.S_ISVTX


def test_existing_mount_point_kept_and_symlinked_one_replaced(tmp_path: Path, rootfs: Path) -> None:
    archive = docker_save(
        tmp_path / "image.tar", [layer(directory("dev"), file("dev/keep"), symlink("tmp", "/var/tmp"))]
    )
    oci.unpack(archive, rootfs)
    assert (rootfs / "dev/keep").exists()
    assert (rootfs / "tmp").is_dir() and not (rootfs / "tmp").is_symlink()


def test_empty_existing_dest_is_accepted_and_non_empty_refused(tmp_path: Path) -> None:
    archive = docker_save(tmp_path / "image.tar", [layer(file("a", b"a"))])
    empty = tmp_path / "empty"
    empty.mkdir()
    oci.unpack(archive, empty)
    assert (empty / "a").read_bytes() == b"a"

    full = tmp_path / "full"
    full.mkdir()
    (full / "precious").write_text("keep me")
    with pytest.raises(oci.ImageError, match="not empty"):
        oci.unpack(archive, full)
    assert (full / "precious").read_text() == "keep me"


def test_failure_into_existing_empty_dest_leaves_it_empty(tmp_path: Path) -> None:
    archive = docker_save(tmp_path / "image.tar", [layer(file("a", b"a"), file("../evil"))])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(oci.ImageError):
        oci.unpack(archive, empty)
    assert empty.is_dir() and not any(empty.iterdir())


# ---- security ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../evil", "/abs", "a/../../evil", "./../evil"])
def test_path_traversal_is_rejected(tmp_path: Path, rootfs: Path, name: str) -> None:
    archive = docker_save(tmp_path / "image.tar", [layer(file("ok", b"ok"), file(name, b"pwned"))])
    error = assert_rejected(archive, rootfs)
    assert "'..'" in str(error) or "absolute" in str(error)
    assert not (tmp_path / "evil").exists()
    assert not (rootfs.parent / "evil").exists()
    assert not Path("/abs").exists()


def test_write_through_symlink_from_lower_layer_is_rejected(
    tmp_path: Path, rootfs: Path, outside: Path
) -> None:
    layers = [layer(symlink("lnk", str(outside))), layer(file("lnk/pwned", b"pwned"))]
    error = assert_rejected(docker_save(tmp_path / "image.tar", layers), rootfs)
    assert "symlink" in str(error)
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]


def test_write_through_relative_symlink_in_same_layer_is_rejected(
    tmp_path: Path, rootfs: Path, outside: Path
) -> None:
    depth = "../" * len(rootfs.relative_to(tmp_path).parts)
    layers = [layer(symlink("lnk", f"{depth}outside-dir"), directory("lnk/sub"), file("lnk/sub/pwned"))]
    assert_rejected(docker_save(tmp_path / "image.tar", layers), rootfs)
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]


@pytest.mark.parametrize("entry", ["lnk/.wh.victim", "lnk/.wh..wh..opq"])
def test_whiteout_through_symlink_is_rejected(
    tmp_path: Path, rootfs: Path, outside: Path, entry: str
) -> None:
    layers = [layer(symlink("lnk", str(outside))), layer(file(entry))]
    assert_rejected(docker_save(tmp_path / "image.tar", layers), rootfs)
    assert (outside / "victim").read_text() == "host data"


def test_symlinks_may_point_anywhere_but_are_replaced_not_followed(
    tmp_path: Path, rootfs: Path, outside: Path
) -> None:
    layers = [
        layer(symlink("bin-sh", "/usr/bin/dash"), symlink("passwd", str(outside / "victim"))),
        layer(file("passwd", b"image passwd")),
    ]
    oci.unpack(docker_save(tmp_path / "image.tar", layers), rootfs)
    assert os.readlink(rootfs / "bin-sh") == "/usr/bin/dash"
    assert (rootfs / "passwd").read_bytes() == b"image passwd"
    assert not (rootfs / "passwd").is_symlink()
    assert (outside / "victim").read_text() == "host data"


def test_directory_entry_replaces_a_symlink_instead_of_following_it(
    tmp_path: Path, rootfs: Path, outside: Path
) -> None:
    layers = [layer(symlink("lnk", str(outside))), layer(directory("lnk"), file("lnk/inside", b"ok"))]
    oci.unpack(docker_save(tmp_path / "image.tar", layers), rootfs)
    assert not (rootfs / "lnk").is_symlink()
    assert (rootfs / "lnk/inside").read_bytes() == b"ok"
    assert sorted(p.name for p in outside.iterdir()) == ["victim"]


@pytest.mark.parametrize("target", ["../outside-dir/victim", "/etc/passwd", "lnk/victim"])
def test_hard_link_outside_is_rejected(tmp_path: Path, rootfs: Path, outside: Path, target: str) -> None:
    layers = [layer(symlink("lnk", str(outside)), hardlink("stolen", target))]
    assert_rejected(docker_save(tmp_path / "image.tar", layers), rootfs)
    assert os.stat(outside / "victim").st_nlink == 1


def test_hard_link_inside_is_kept(tmp_path: Path, rootfs: Path) -> None:
    layers = [layer(file("bin/real", b"binary", 0o755)), layer(hardlink("bin/alias", "./bin/real"))]
    oci.unpack(docker_save(tmp_path / "image.tar", layers), rootfs)
    assert os.stat(rootfs / "bin/alias").st_ino == os.stat(rootfs / "bin/real").st_ino


def test_hard_link_to_missing_file_is_rejected(tmp_path: Path, rootfs: Path) -> None:
    assert_rejected(docker_save(tmp_path / "image.tar", [layer(hardlink("a", "nowhere"))]), rootfs)


def test_setuid_and_setgid_bits_are_stripped(tmp_path: Path, rootfs: Path) -> None:
    layers = [
        layer(
            file("usr/bin/sudo", b"#!", 0o4755),
            file("usr/bin/wall", b"#!", 0o2755),
            directory("shared", 0o3775),
        )
    ]
    oci.unpack(docker_save(tmp_path / "image.tar", layers), rootfs)
    assert stat.S_IMODE(os.stat(rootfs / "usr/bin/sudo").st_mode) == 0o755
    assert stat.S_IMODE(os.stat(rootfs / "usr/bin/wall").st_mode) == 0o755
    assert stat.S_IMODE(os.stat(rootfs / "shared").st_mode) == 0o1775


def test_device_nodes_and_fifos_are_skipped(tmp_path: Path, rootfs: Path) -> None:
    layers = [
        layer(
            special("dev/null", tarfile.CHRTYPE),
            special("dev/sda", tarfile.BLKTYPE),
            special("run/fifo", tarfile.FIFOTYPE),
            file("after", b"still extracted"),
        )
    ]
    oci.unpack(docker_save(tmp_path / "image.tar", layers), rootfs)
    assert not (rootfs / "dev/null").exists()
    assert not (rootfs / "dev/sda").exists()
    assert not (rootfs / "run/fifo").exists()
    assert (rootfs / "after").read_bytes() == b"still extracted"


def test_size_cap_is_enforced(tmp_path: Path, rootfs: Path) -> None:
    layers = [layer(file("a", b"x" * 600)), layer(file("b", b"y" * 600))]
    archive = docker_save(tmp_path / "image.tar", layers)
    error = assert_rejected(archive, rootfs, max_bytes=1000)
    assert "1000 bytes" in str(error)
    oci.unpack(archive, rootfs, max_bytes=1200)


def test_member_cap_is_enforced(tmp_path: Path, rootfs: Path) -> None:
    archive = docker_save(tmp_path / "image.tar", [layer(*(file(f"f{i}") for i in range(20)))])
    assert_rejected(archive, rootfs, max_members=10)


def _raw_header(name: str, kind: bytes, size: int) -> bytes:
    """One ustar header declaring ``size`` bytes of data (which need not follow)."""
    info = tarfile.TarInfo(name)
    info.type, info.size = kind, size
    return info.tobuf(format=tarfile.USTAR_FORMAT)


@pytest.mark.parametrize("kind", [tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME])
def test_a_huge_pax_or_long_name_header_is_refused_before_it_is_read(
    tmp_path: Path, rootfs: Path, kind: bytes
) -> None:
    """``tarfile`` reads such a header whole into memory: 8 MiB declared (of zeros that
    gzip to a few KiB) is refused from its size, without being read."""
    raw = _raw_header("././@PaxHeader", kind, 8 * 1024**2) + b"\0" * (8 * 1024**2 + 1024)
    bomb = gzip.compress(raw, 9)
    assert len(bomb) < 64 * 1024
    error = assert_rejected(docker_save(tmp_path / "image.tar", [bomb]), rootfs)
    assert "tar header of 8388608 bytes" in str(error)


@pytest.mark.parametrize(
    ("entry", "said"),
    [
        (file("a/" * 300 + "deep"), "more than 256 directories deep"),
        (file("n" * 5000), "longer than 4096 characters"),
        (hardlink("link", "a/" * 300 + "deep"), "more than 256 directories deep"),
    ],
    ids=["deep", "long", "deep-link"],
)
def test_huge_names_and_depths_are_refused(tmp_path: Path, rootfs: Path, entry: Entry, said: str) -> None:
    error = assert_rejected(docker_save(tmp_path / "image.tar", [layer(entry)]), rootfs)
    assert said in str(error)


def test_directories_an_entry_implies_count_as_entries(tmp_path: Path, rootfs: Path) -> None:
    """One entry 200 directories deep makes 200 inodes: counted, so an inode bomb of a few
    entries stops at the cap."""
    deep = "/".join(f"d{i}" for i in range(200)) + "/f"
    archive = docker_save(tmp_path / "image.tar", [layer(file(deep))])
    assert "more than 100 entries" in str(assert_rejected(archive, rootfs, max_members=100))
    oci.unpack(archive, rootfs, max_members=300)


@pytest.mark.parametrize("name", ["../pax-escape", "/pax-absolute"])
def test_a_pax_path_is_checked_like_any_name(tmp_path: Path, rootfs: Path, name: str) -> None:
    """A PAX ``path`` record replaces the header's (harmless) name: the real one is checked."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("harmless")
        info.size, info.pax_headers = 5, {"path": name}
        tar.addfile(info, io.BytesIO(b"pwned"))
    assert_rejected(docker_save(tmp_path / "image.tar", [buffer.getvalue()]), rootfs)
    assert not (rootfs.parent / "pax-escape").exists() and not Path("/pax-absolute").exists()


def test_a_guard_stops_the_unpack_before_each_write(tmp_path: Path) -> None:
    """What a pull uses to keep the filesystem's reserve: told before every entry and
    every file's bytes, it can stop the unpack, which then leaves nothing."""
    told: list[tuple[int, int]] = []

    def guard(more_bytes: int, more_entries: int) -> None:
        told.append((more_bytes, more_entries))
        if more_bytes > 1000:
            raise errors.LimitExceeded("the reserve")

    budget = oci.Budget(max_bytes=10**9, max_members=10**6, guard=guard)
    dest = tmp_path / "layer"
    dest.mkdir()
    data = layer(file("small", b"x" * 10), file("big", b"y" * 5000))
    with pytest.raises(errors.LimitExceeded), oci.open_layer(io.BytesIO(data)) as tar:
        oci.Extractor(str(dest), budget).run(tar)
    assert (0, 1) in told and (10, 0) in told and (5000, 0) in told
    assert not (dest / "big").exists()
