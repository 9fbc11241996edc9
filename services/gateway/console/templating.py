"""HTML from templates whose every interpolation is escaped unless it is already HTML.

Templates are files under ``templates/`` using :class:`string.Template` placeholders
(``$name``). :func:`render` escapes every value it is given (text, numbers, None) for
element content and double-quoted attributes alike; only a :class:`Markup` — what
:func:`render` and :func:`join` return — goes in as it is. So the one way to put HTML into
a page is to render it from a template, and forgetting to escape is not possible. A
placeholder without a value is an error, never an empty string.
"""

from __future__ import annotations

import functools
import html
import re
import string
from collections.abc import Iterable
from pathlib import Path

TEMPLATES = Path(__file__).parent / "templates"


class Markup(str):
    """Trusted HTML. Made only by :func:`render` and :func:`join` (and :data:`EMPTY`)."""

    __slots__ = ()


EMPTY = Markup("")


_BIDI = re.compile("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
"""Characters that reorder the text around them (U+202E reverses what follows): a value
shows them as escapes (``\\u202e``), so a command cannot disguise itself in a table."""


def escape(value: object) -> Markup:
    if isinstance(value, Markup):
        return value
    text = _BIDI.sub(lambda m: f"\\u{ord(m.group()):04x}", "" if value is None else str(value))
    return Markup(html.escape(text, quote=True))


@functools.cache
def _template(name: str) -> string.Template:
    path = (TEMPLATES / name).resolve()
    if path.parent != TEMPLATES.resolve():
        raise ValueError(f"no such template: {name!r}")
    return string.Template(path.read_text(encoding="utf-8"))


def render(name: str, /, **values: object) -> Markup:
    """The template ``name`` with every value escaped (a :class:`Markup` as it is)."""
    return Markup(_template(name).substitute({key: escape(value) for key, value in values.items()}))


def join(parts: Iterable[Markup]) -> Markup:
    """Rendered pieces one after the other (a loop's rows)."""
    pieces = list(parts)
    for piece in pieces:
        if not isinstance(piece, Markup):
            raise TypeError("join takes rendered HTML only (render it from a template)")
    return Markup("".join(pieces))
