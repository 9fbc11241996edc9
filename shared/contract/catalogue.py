"""Renders the event catalogue (docs/events.md) from the types themselves.

``python -m shared.contract.catalogue > docs/events.md``; a test fails when the file and
the types disagree, so the catalogue can never drift from the code.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any

import msgspec

from shared.contract import codec, commands, events, states

HEADER = """# Event catalogue

Generated from `shared/contract/events.py` and `shared/contract/commands.py` by
`python -m shared.contract.catalogue > docs/events.md` (a test keeps it current).

Every event is stored as one JSON object on the `<NS>_EVENTS` stream, on the subject of
its aggregate (`<ns>.evt.<kind>.<token>`), with `type` (the stable tag), `v` (the schema
version of that type), `meta` (causation and attribution) and its own fields.

## Version rules

* A tag never changes and is never reused; renaming a class does not touch it.
* Adding a field **with a default** is compatible: `v` stays, old payloads decode with
  the default, old readers ignore the new field.
* Removing, renaming or retyping a field bumps `v` and registers an upcaster in
  `shared/contract/codec.py` (`UPCASTERS[(type, old_v)]`) that turns the old payload into the new
  shape before decoding. Stored samples of every type in `tests/samples/` must keep
  decoding.
* A payload with a `v` newer than the reader knows is refused (`CorruptEvent`), never
  guessed at.
"""


def _type_name(tp: Any) -> str:
    text = inspect.formatannotation(tp)
    return text.replace("typing.", "").replace("NoneType", "None").replace("datetime.", "")


def _fields(cls: type[msgspec.Struct], skip: tuple[str, ...] = ()) -> list[str]:
    hints = typing.get_type_hints(cls)
    rows = ["| field | type | default |", "|---|---|---|"]
    for field in msgspec.structs.fields(cls):
        if field.name in skip:
            continue
        if field.default is not msgspec.NODEFAULT:
            default = f"`{msgspec.json.encode(field.default).decode()}`"
        elif field.default_factory is not msgspec.NODEFAULT:
            default = f"`{msgspec.json.encode(field.default_factory()).decode()}`"
        else:
            default = "required"
        type_name = _type_name(hints[field.name]).replace("|", "\\|")
        rows.append(f"| `{field.name}` | `{type_name}` | {default} |")
    return rows


def _doc(cls: type) -> str:
    return inspect.cleandoc(cls.__doc__ or "").replace("\n", " ")


def render() -> str:
    out = [HEADER, "## Metadata on every event (`meta`)", "", *_fields(events.Meta), ""]
    by_kind: dict[str, list[type[events.Event]]] = {}
    for cls in events.EVENT_TYPES:
        by_kind.setdefault(cls.kind, []).append(cls)
    for kind, classes in by_kind.items():
        out += [f"## `{kind}` events", ""]
        for cls in classes:
            tag = events.tag_of(cls)
            out += [
                f"### `{tag}` (v{codec.CURRENT_VERSION[tag]})",
                "",
                _doc(cls),
                "",
                *_fields(cls, skip=("v", "meta")),
                "",
            ]
    out += [
        "## Commands",
        "",
        "Sent by request/reply to `<ns>.cmd.session` (queue group `scheduler`); each reply is a "
        "`CommandReply`. `command_id` makes a retry harmless.",
        "",
    ]
    for command in commands.COMMAND_TYPES:
        out += [f"### `{events.tag_of(command)}`", "", *_fields(command), ""]
    out += ["### `CommandReply`", "", *_fields(commands.CommandReply), ""]
    out += ["## Projected states (KV values)", ""]
    for state in (states.SessionState, states.InstanceState):
        out += [f"### `{state.__name__}`", "", *_fields(state), ""]
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    print(render(), end="")
