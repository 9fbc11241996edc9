"""One error hierarchy for the whole product.

Every error a user can see derives from :class:`SandboxError` and carries a
stable machine ``code`` plus a human message. The gateway maps each family to
an HTTP status; services map NATS errors into these at the adapter boundary.
"""

from __future__ import annotations


class SandboxError(Exception):
    """Root of every error the product raises on purpose."""

    code = "internal"
    #: HTTP status the gateway answers with.
    status = 500
    #: Whether the same request may succeed if retried later.
    retriable = False

    def __init__(self, message: str, **details: str) -> None:
        super().__init__(message)
        self.message = message
        self.details = details


# ---- input and domain ------------------------------------------------------


class InvalidInput(SandboxError):
    """The request itself is wrong: fix it before retrying."""

    code = "invalid_input"
    status = 400


class Unauthorized(SandboxError):
    code = "unauthorized"
    status = 401


class Forbidden(SandboxError):
    """The key is valid but does not allow this (a key bound to another organisation)."""

    code = "forbidden"
    status = 403


class NotFound(SandboxError):
    code = "not_found"
    status = 404


class NotAcceptable(SandboxError):
    """The request's Accept header admits none of the media types the route answers with."""

    code = "not_acceptable"
    status = 406


class UnsupportedMediaType(SandboxError):
    """The request's body is not of a media type the route takes."""

    code = "unsupported_media_type"
    status = 415


class Conflict(SandboxError):
    """The request contradicts the current state (e.g. the session exists)."""

    code = "conflict"
    status = 409


class SandboxChanged(Conflict):
    """The session's sandbox is not the one the caller synced with (it was replaced or
    reaped meanwhile): nothing was done; sync everything again and retry."""

    code = "sandbox_changed"


class ImageUnavailable(Conflict):
    """The session's image cannot be had from its registry (no such repository or tag, a
    host that does not resolve, access refused, a broken image): the request itself is
    well-formed, the session's image is not usable; re-provision with another image."""

    code = "image_unavailable"


class NotRunning(Conflict):
    """The sandbox exists but is not running (stopped, or its processes died)."""

    code = "not_running"


class Cancelled(SandboxError):
    """The caller cancelled the call (or went away); what it ran was stopped."""

    code = "cancelled"
    status = 499


class LimitExceeded(SandboxError):
    code = "limit_exceeded"
    status = 429
    retriable = True


class NotBuiltYet(SandboxError):
    """A documented capability that this version does not provide yet."""

    code = "not_implemented"
    status = 501


class InvalidTransition(SandboxError):
    """An event that cannot follow the aggregate's current state.

    ``decide`` never emits one; seeing it while folding means a corrupt stream.
    """

    code = "invalid_transition"


# ---- infrastructure ----------------------------------------------------------


class InfrastructureError(SandboxError):
    code = "infrastructure"
    status = 503
    retriable = True


class Unavailable(InfrastructureError):
    """No instance of a needed service answered (it may be restarting)."""

    code = "unavailable"


class Timeout(InfrastructureError):
    """A request took too long; its outcome is unknown, retrying is safe."""

    code = "timeout"
    status = 504


class ConcurrencyError(InfrastructureError):
    """Optimistic concurrency lost: another writer appended first. Reload and retry."""

    code = "concurrency"
    status = 409


class ConfigError(SandboxError):
    """Settings are missing or invalid; the process refuses to start."""

    code = "config"


class CorruptEvent(SandboxError):
    """A stored payload does not decode with any known schema version."""

    code = "corrupt_event"


BY_CODE: dict[str, type[SandboxError]] = {
    cls.code: cls
    for cls in (
        SandboxError,
        InvalidInput,
        Unauthorized,
        Forbidden,
        NotFound,
        NotAcceptable,
        UnsupportedMediaType,
        Conflict,
        SandboxChanged,
        ImageUnavailable,
        NotRunning,
        LimitExceeded,
        Cancelled,
        NotBuiltYet,
        InvalidTransition,
        InfrastructureError,
        Unavailable,
        Timeout,
        ConcurrencyError,
        ConfigError,
        CorruptEvent,
    )
}


def from_code(code: str, message: str) -> SandboxError:
    """Rebuild an error received over the bus (unknown codes become the root type)."""
    return BY_CODE.get(code, SandboxError)(message)
