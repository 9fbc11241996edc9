"""Choosing and opening a runtime backend by name: the one place services get a runtime from."""

from __future__ import annotations

from pathlib import Path

from shared import errors
from shared.runtime import api

NAMES = ("local",)


def open_runtime(name: str, state_dir: Path) -> api.Runtime:
    if name == "local":
        from shared.runtime.local import runtime

        return runtime.LocalRuntime(state_dir)
    raise errors.ConfigError(f"unknown runtime {name!r}; available here: {', '.join(NAMES)}")


def image_store(name: str, state_dir: Path):  # type: ignore[no-untyped-def]
    """The backend's image registry (local: root filesystems under the state dir)."""
    if name == "local":
        from shared.runtime.local import images

        return images.ImageStore(state_dir / "images")
    raise errors.ConfigError(f"the {name!r} runtime has no local image store")
