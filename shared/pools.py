"""Warm pool specs: the contract between the pool-manager (which fills pools) and the
scheduler (which claims from them). A pool's id carries a hash of its spec, so changing
the spec makes a new pool."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

from shared import settings


@dataclass(frozen=True)
class PoolSpec:
    name: str = "default"
    image: str = "default"
    run_as_root: bool = True
    writable_root: bool = True
    min_idle: int = 2

    @property
    def pool_id(self) -> str:
        """``name@hash``: what sandboxes of this pool carry in ``pool``."""
        shape = json.dumps([self.image, self.run_as_root, self.writable_root]).encode()
        return f"{self.name}@{hashlib.blake2b(shape, digest_size=4).hexdigest()}"

    def serves(self, options: Mapping[str, object]) -> bool:
        """Whether a sandbox of this pool fits a session asking for these options."""
        return (
            options.get("image", "default") == self.image
            and options.get("run_as_root", True) == self.run_as_root
            and options.get("writable_root", True) == self.writable_root
            and not options.get("use_kata", False)
        )


def configured(lifecycle: settings.LifecycleSettings) -> list[PoolSpec]:
    """The pools to keep warm: the default one (``SBX_POOL_*``) and any in ``SBX_POOLS``."""
    specs = (
        [PoolSpec(image=lifecycle.pool_image, min_idle=lifecycle.pool_min_idle)]
        if lifecycle.pool_min_idle
        else []
    )
    for name, image, run_as_root, writable_root, min_idle in lifecycle.extra_pools:
        if min_idle:
            specs.append(PoolSpec(name, image, run_as_root, writable_root, min_idle))
    return specs


def serving(specs: list[PoolSpec], options: Mapping[str, object]) -> PoolSpec | None:
    """The first pool whose sandboxes fit these options."""
    return next((spec for spec in specs if spec.serves(options)), None)
