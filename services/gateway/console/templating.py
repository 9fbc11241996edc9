"""The console's HTML: Jinja2 templates under ``templates/`` with autoescape on.

Every ``{{ value }}`` is HTML-escaped (element content and quoted attributes alike), with
characters that reorder the text around them shown as escapes first; ``None`` shows as
nothing. Templates get plain values from the view models (:mod:`.views`), never HTML: none
marks a value safe (no ``|safe``, no ``Markup`` outside this module's tests), so what a
tenant wrote is always text. A name a template uses without a value is an error, never an
empty string; a template name outside ``templates/`` is not found.
"""

from __future__ import annotations

import re
from pathlib import Path

import jinja2
import markupsafe

from services.gateway.console import views

TEMPLATES = Path(__file__).parent / "templates"

_BIDI = re.compile("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
"""Characters that reorder the text around them (U+202E reverses what follows): a value
shows them as escapes (``\\u202e``), so a command cannot disguise itself in a table."""


def shown(value: object) -> object:
    """What a ``{{ value }}`` shows before it is escaped: None as nothing, text with its
    reordering characters as escapes (HTML the engine made itself, e.g. a macro's output,
    as it is)."""
    if isinstance(value, markupsafe.Markup):
        return value
    if value is None:
        return ""
    return _BIDI.sub(lambda m: f"\\u{ord(m.group()):04x}", str(value))


ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(TEMPLATES),
    autoescape=True,  # every template is HTML
    undefined=jinja2.StrictUndefined,
    finalize=shown,
    trim_blocks=True,
    lstrip_blocks=True,
    auto_reload=False,
)
ENV.globals["href"] = views.href


def render(name: str, /, **values: object) -> str:
    """The page (or piece) ``name`` with these values, every one escaped."""
    return ENV.get_template(name).render(values)
