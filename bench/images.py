"""Starting sandboxes of registry images on the local runtime, side by side with `default`.

A real registry (docker-registry on loopback) serves an image written here: busybox, the
host's bash, and the host's Python standard library (tens of MB, several layers). Prints,
in one run:

* **first start** of the image: pull (download, digest checks, unpack) + create + start;
* **cached start**: create + start of another sandbox of it (the layers are shared);
* **`default` start**: create + start of a sandbox of the built-in image;
  the cached/default ratio is the cost of an image's overlay over `default`'s binds;
* **ten concurrent new sandboxes of one uncached image**: wall time, and how many layer
  downloads they made between them (one pull: each layer once).

Figures only; nothing is asserted. Needs root, docker-registry and skopeo.

    .venv/bin/python bench/images.py [--rounds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.runtime import api
from shared.runtime.local import runtime as local
from tests import oci_registry as o


def stdlib_layers(root: Path) -> list[bytes]:
    """The host's Python standard library, split in a few layers as image builds split it."""
    lib = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    groups: dict[str, list[Path]] = {"a": [], "b": [], "c": []}
    for path in sorted(lib.iterdir()):
        if path.name in ("site-packages", "test", "__pycache__"):
            continue
        groups["abc"[hash(path.name) % 3]].append(path)
    out = []
    for index, paths in enumerate(groups.values()):
        tar_path = root / f"layer{index}.tar"
        with tarfile.open(tar_path, "w:gz", compresslevel=6) as tar:
            for path in paths:
                tar.add(path, arcname=f"usr/lib/python3/{path.name}", filter=_no_cache)
        out.append(tar_path.read_bytes())
    return out


def _no_cache(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    return None if "__pycache__" in info.name else info


async def timed_start(rt: local.LocalRuntime, sandbox_id: str, image: str) -> float:
    started = time.perf_counter()
    await rt.create(api.SandboxSpec(sandbox_id=sandbox_id, image=image))
    await rt.start(sandbox_id)
    return time.perf_counter() - started


async def main(rounds: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="sbx-bench-images-"))
    reg = o.Registry(work / "registry").start()
    try:
        layers = [o.host_bash_layer(), *stdlib_layers(work)]
        size = sum(len(layer) for layer in layers) + len(o.busybox_layer())
        for tag in range(rounds + 1):  # a new digest per round (a marker layer): a first pull every round
            o.simple_image(work / f"layout{tag}", *layers, o.layer({"etc/round": str(tag).encode()}))
            reg.push(work / f"layout{tag}", f"bench/py:{tag}")
        print(f"image: {len(layers) + 2} layers, {size / 1024**2:.1f} MiB compressed, from {reg.host}")
        first, cached, default = [], [], []
        for tag in range(rounds):
            rt = local.LocalRuntime(work / f"state{tag}")  # an empty layer store each round
            image = f"{reg.host}/bench/py:{tag}"
            first.append(await timed_start(rt, f"first-{tag}", image))
            cached.append(await timed_start(rt, f"cached-{tag}", image))
            default.append(await timed_start(rt, f"default-{tag}", "default"))
            _, out, _ = await rt.run(f"cached-{tag}", ["/bin/sh", "-c", "cat /etc/round"])
            assert out.decode() == str(tag), out
            for info in await rt.list():
                await rt.delete(info.sandbox_id)

        def line(name: str, values: list[float]) -> str:
            ms = sorted(v * 1000 for v in values)
            return f"{name:<34} min {ms[0]:8.1f}  median {statistics.median(ms):8.1f}  max {ms[-1]:8.1f} ms"

        print(line("first start (pull+create+start)", first))
        print(line("cached start (create+start)", cached))
        print(line("default start (create+start)", default))
        print(f"cached / default (medians): {statistics.median(cached) / statistics.median(default):.2f}x")

        rt = local.LocalRuntime(work / "concurrent")
        image = f"{reg.host}/bench/py:{rounds}"
        started = time.perf_counter()
        pulls = await asyncio.gather(*(rt.pull(image) for _ in range(10)))
        await asyncio.gather(*(timed_start(rt, f"c{i}", image) for i in range(10)))
        wall = time.perf_counter() - started
        fetched = sum(p.fetched for p in pulls if p is not None)
        print(
            f"10 concurrent new sandboxes of one uncached image: {wall * 1000:.0f} ms wall, "
            f"{fetched} layer downloads in all for {pulls[0].layers if pulls[0] else 0} layers"
        )
        for info in await rt.list():
            await rt.delete(info.sandbox_id)
    finally:
        reg.stop()
        import shutil

        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=10)
    asyncio.run(main(parser.parse_args().rounds))
