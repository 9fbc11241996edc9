"""Semantics of the ``str_replace_based_edit_tool`` text editor, as pure functions.

Coding agents are trained on Anthropic's text editor tool (``view``, ``create``,
``str_replace``, ``insert``); this module reproduces its behaviour and messages so
that an agent driving our sandboxes can use it exactly as it learnt to.

The module is **pure**: no I/O, no subprocess, no filesystem access. Every
function takes the bytes or text it works on and returns new bytes or text. The
executor reads a file's bytes from *inside* the sandbox, calls these functions,
and writes the result back from *inside* the sandbox. The host never resolves or
follows a path into a sandbox (a symlink planted there could otherwise point it
at the host's own files), and keeping the logic here free of side effects makes
every rule testable without a sandbox.

Conventions shared by all functions:

* Errors an agent can fix raise :class:`sbx_api.errors.InvalidInput` with a message
  saying what was wrong and what to do instead.
* A file's lines are separated by ``"\\n"`` only (never by the other characters
  ``str.splitlines`` knows); a final ``"\\n"`` ends the last line rather than
  starting an empty one, so ``"a\\nb\\n"`` has 2 lines and ``""`` has 0.
* A file whose every ``"\\n"`` is preceded by ``"\\r"`` is a CRLF file: it is shown
  and matched as if its line endings were ``"\\n"`` (so an ``old_str`` copied from
  ``view`` matches), and every line ending of the result, inserted lines
  included, is written back as ``"\\r\\n"``. Other files are handled verbatim.
* Tabs and all other characters are preserved verbatim (tabs are not expanded).
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence

from sbx_api.errors import InvalidInput

#: Largest output ``view`` returns (line numbers included) before truncating.
MAX_VIEW_BYTES = 256 * 1024
#: Largest file the edit tool reads or writes.
MAX_FILE_BYTES = 10 * 1024 * 1024
#: Lines of context shown around an edit.
SNIPPET_CONTEXT_LINES = 4
#: A NUL byte this early in a file marks it as binary.
BINARY_SNIFF_BYTES = 8 * 1024
#: At most this many occurrences are located when ``old_str`` is not unique.
_MAX_REPORTED_OCCURRENCES = 100

_SHELL_HINT = "use the shell tool to inspect or change it instead"


# ---- paths and encoding -----------------------------------------------------------------


def decode_text(data: bytes, path: str) -> str:
    """Decode a file's bytes as UTF-8 text, refusing binary and oversized files."""
    size = len(data)
    if size > MAX_FILE_BYTES:
        raise InvalidInput(
            f"{path} is {size} bytes, larger than the edit tool's limit of {MAX_FILE_BYTES} bytes "
            f"(10 MiB); {_SHELL_HINT} (e.g. head, tail, grep, sed)."
        )
    if b"\x00" in data[:BINARY_SNIFF_BYTES]:
        raise InvalidInput(_binary_message(path, size, "it contains a NUL byte"))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInput(
            _binary_message(path, size, f"it is not valid UTF-8 (at byte {exc.start})")
        ) from None


def _binary_message(path: str, size: int, reason: str) -> str:
    return (
        f"{path} looks like a binary file ({size} bytes): {reason}. The edit tool only handles "
        f"UTF-8 text files; {_SHELL_HINT} (e.g. file, xxd, head -c)."
    )


def encode_text(text: str) -> bytes:
    """Encode text to the UTF-8 bytes to write back, enforcing :data:`MAX_FILE_BYTES`."""
    if not isinstance(text, str):
        raise InvalidInput(f"file content must be a string, got {type(text).__name__}")
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInput(
            f"the text contains a character that cannot be encoded as UTF-8 at position {exc.start} "
            "(an unpaired surrogate); remove it and try again"
        ) from None
    if len(data) > MAX_FILE_BYTES:
        raise InvalidInput(
            f"the resulting file would be {len(data)} bytes, larger than the edit tool's limit of "
            f"{MAX_FILE_BYTES} bytes (10 MiB); write it in smaller files or with the shell tool"
        )
    return data


def create_file(file_text: str) -> bytes:
    """Return the bytes of a file created with ``file_text``.

    Like Anthropic's tool, ``create`` **overwrites** an existing file at the path
    without complaint: the executor writes these bytes whether or not one exists.
    """
    return encode_text(file_text)


# ---- line model ---------------------------------------------------------------------------


def _is_crlf(text: str) -> bool:
    """Whether every line ending of ``text`` is ``"\\r\\n"`` (and there is at least one)."""
    newlines = text.count("\n")
    return newlines > 0 and text.count("\r\n") == newlines


def _split_lines(text: str) -> list[str]:
    """The lines of ``text`` without their ``"\\n"``; a final ``"\\n"`` adds no empty line."""
    if not text:
        return []
    lines = text.split("\n")
    if text.endswith("\n"):
        lines.pop()
    return lines


def _number(line_no: int, line: str) -> str:
    return f"{line_no:6}\t{line}"


def _truncation_marker(total_lines: int) -> str:
    return f"[... output truncated: file has {total_lines} lines; use view_range to see more]"


def _render(lines: Sequence[str], first_line_no: int, total_lines: int) -> str:
    """Number ``lines`` (the first is ``first_line_no``) like ``cat -n``, within MAX_VIEW_BYTES.

    When the output would be larger, whole lines are kept while they fit (or the
    start of the first line when even it does not) and a marker line is appended;
    the whole output, marker included, stays within MAX_VIEW_BYTES.
    """
    marker = _truncation_marker(total_lines)
    budget = MAX_VIEW_BYTES - len(marker.encode("utf-8")) - 1
    out: list[str] = []
    used = 0
    for offset, line in enumerate(lines):
        rendered = _number(first_line_no + offset, line)
        size = len(rendered.encode("utf-8")) + (1 if out else 0)
        if used + size > MAX_VIEW_BYTES:
            break
        out.append(rendered)
        used += size
    else:
        return "\n".join(out)
    # Truncate: drop whole lines until the marker fits too.
    while out and used > budget:
        used -= len(out.pop().encode("utf-8")) + (1 if out else 0)
    if not out:
        rendered = _number(first_line_no, lines[0])
        out.append(rendered.encode("utf-8")[:budget].decode("utf-8", errors="ignore"))
    out.append(marker)
    return "\n".join(out)


def _snippet(text: str, first: int, last: int) -> str:
    """The lines ``first..last`` (1-indexed) of ``text`` with context around, numbered."""
    lines = _split_lines(text)
    if not lines:
        return ""
    first = min(max(first, 1), len(lines))
    last = min(max(last, first), len(lines))
    start = max(1, first - SNIPPET_CONTEXT_LINES)
    end = min(len(lines), last + SNIPPET_CONTEXT_LINES)
    return _render(lines[start - 1 : end], start, len(lines))


# ---- view ---------------------------------------------------------------------------------


def view_file(text: str, path: str, view_range: Sequence[int] | None) -> str:
    """Return ``text`` numbered like ``cat -n`` (``f"{n:6}\\t{line}"`` per line).

    ``view_range`` is ``[start, end]``, 1-indexed and inclusive; ``end`` may be
    ``-1`` for "to the end of the file".
    """
    if _is_crlf(text):
        text = text.replace("\r\n", "\n")
    lines = _split_lines(text)
    total = len(lines)
    if view_range is None:
        if total == 0:
            return f"[the file {path} is empty]"
        return _render(lines, 1, total)

    if (
        not isinstance(view_range, list | tuple)
        or len(view_range) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in view_range)
    ):
        raise InvalidInput(
            f"view_range must be a list of exactly two integers [start, end], got {view_range!r}; "
            "e.g. [1, 20], or [10, -1] for line 10 to the end of the file"
        )
    start, end = view_range
    shown = f"[{start}, {end}]"
    if total == 0:
        raise InvalidInput(
            f"view_range {shown} cannot be used: the file {path} is empty (0 lines); "
            "view it without view_range"
        )
    valid = f"the file has {total} lines; use [1, {total}] or [1, -1]"
    if start < 1:
        raise InvalidInput(
            f"view_range {shown} is invalid: start must be at least 1 (lines are 1-indexed); {valid}"
        )
    if start > total:
        raise InvalidInput(f"view_range {shown} is out of bounds: {valid}")
    if end != -1:
        if end < start:
            raise InvalidInput(
                f"view_range {shown} is invalid: end must be at least start, or -1 for the end of the file; "
                f"{valid}"
            )
        if end > total:
            raise InvalidInput(f"view_range {shown} is out of bounds: {valid}")
    stop = total if end == -1 else end
    return _render(lines[start - 1 : stop], start, total)


def view_directory(entries: Sequence[tuple[str, str]], path: str) -> str:
    """Render a directory listing like Anthropic's tool.

    ``entries`` are ``(relative_name, kind)`` pairs with ``kind`` ``"dir"`` or
    ``"file"``, already collected by the caller (two levels deep, hidden entries
    excluded). Each is shown as its full path, directories with a trailing ``/``,
    sorted by path components (so a directory's content follows it).
    """
    header = f"Here are the files and directories up to 2 levels deep in {path}, excluding hidden items:"
    rows: list[tuple[list[str], str]] = []
    for name, kind in entries:
        if kind not in ("dir", "file"):
            raise ValueError(f"entry kind must be 'dir' or 'file', got {kind!r} for {name!r}")
        relative = name.strip("/")
        full = posixpath.join(path, relative)
        rows.append((relative.split("/"), full + "/" if kind == "dir" else full))
    rows.sort()
    if not rows:
        return f"{header}\n[the directory is empty]"
    lines = [header] + [line for _, line in rows]
    if len("\n".join(lines).encode("utf-8")) <= MAX_VIEW_BYTES:
        return "\n".join(lines)
    marker = f"[... output truncated: {len(rows)} entries; view a subdirectory to see more]"
    budget = MAX_VIEW_BYTES - len(marker.encode("utf-8")) - 1
    out = [header]
    used = len(header.encode("utf-8"))
    for line in lines[1:]:
        size = len(line.encode("utf-8")) + 1
        if used + size > budget:
            break
        out.append(line)
        used += size
    out.append(marker)
    return "\n".join(out)


# ---- edits --------------------------------------------------------------------------------


def edit_message(path: str, snippet: str) -> str:
    """The success message of ``str_replace`` and ``insert``, as Anthropic's tool words it."""
    return (
        f"The file {path} has been edited. Here's the result of running `cat -n` on a snippet of {path}:\n"
        f"{snippet}\n"
        "Review the changes and make sure they are as expected. Edit the file again if necessary."
    )


def _find_occurrences(text: str, needle: str, limit: int) -> list[int]:
    """Start offsets of ``needle`` in ``text``, overlapping ones included, at most ``limit``."""
    found: list[int] = []
    index = text.find(needle)
    while index != -1 and len(found) < limit:
        found.append(index)
        index = text.find(needle, index + 1)
    return found


def _line_numbers(text: str, offsets: list[int]) -> list[int]:
    """1-indexed line number of each (ascending) offset in ``text``."""
    numbers: list[int] = []
    line, previous = 1, 0
    for offset in offsets:
        line += text.count("\n", previous, offset)
        previous = offset
        numbers.append(line)
    return numbers


def _squash_whitespace(text: str) -> str:
    """Each line stripped with inner whitespace runs collapsed; line count is kept."""
    return "\n".join(" ".join(line.split()) for line in text.split("\n"))


def _whitespace_hint(text: str, old_str: str) -> str:
    """Where ``old_str`` would match if whitespace were ignored, as a sentence (or "")."""
    needle = _squash_whitespace(old_str).strip()
    if not needle:
        return ""
    haystack = _squash_whitespace(text)
    index = haystack.find(needle)
    if index == -1:
        return ""
    line = haystack.count("\n", 0, index) + 1
    return (
        f" A similar text exists with different whitespace (indentation, spaces, tabs or line endings) "
        f"at line {line}; view that part of the file and copy old_str from it exactly."
    )


def str_replace(text: str, old_str: str, new_str: str | None, path: str) -> tuple[str, str]:
    """Replace the single occurrence of ``old_str`` in ``text`` by ``new_str``.

    ``new_str`` ``None`` deletes ``old_str``. Returns ``(new_text, snippet)`` where
    the snippet shows the edited lines with context, for :func:`edit_message`.
    """
    if not isinstance(old_str, str) or not old_str:
        raise InvalidInput(
            "old_str must be a non-empty string: the exact text to replace, copied from the file "
            "(to add text without replacing any, use the insert command)"
        )
    if new_str is None:
        new_str = ""
    if not isinstance(new_str, str):
        raise InvalidInput(f"new_str must be a string, got {type(new_str).__name__}")
    crlf = _is_crlf(text)
    if crlf:
        text = text.replace("\r\n", "\n")
        old_str = old_str.replace("\r\n", "\n")
        new_str = new_str.replace("\r\n", "\n")
    if old_str == new_str:
        raise InvalidInput(
            "No replacement was performed: old_str and new_str are identical; new_str must be the "
            "text that replaces old_str."
        )

    offsets = _find_occurrences(text, old_str, _MAX_REPORTED_OCCURRENCES + 1)
    if not offsets:
        raise InvalidInput(
            f"No replacement was performed, old_str did not appear verbatim in {path}."
            + (
                _whitespace_hint(text, old_str)
                or " It must match the file exactly, including whitespace and indentation; "
                "view the file to check."
            )
        )
    if len(offsets) > 1:
        more = len(offsets) > _MAX_REPORTED_OCCURRENCES
        lines = sorted(set(_line_numbers(text, offsets[:_MAX_REPORTED_OCCURRENCES])))
        where = f"{lines}" + (" and more" if more else "")
        raise InvalidInput(
            f"No replacement was performed. Multiple occurrences of old_str in lines {where}. "
            "Please ensure it is unique by including more surrounding lines in old_str."
        )

    offset = offsets[0]
    new_text = text[:offset] + new_str + text[offset + len(old_str) :]
    first = text.count("\n", 0, offset) + 1
    last = first + new_str.count("\n")
    if new_str.endswith("\n") and old_str.endswith("\n"):
        last -= 1  # the line after the edit is untouched
    snippet = _snippet(new_text, first, last)
    if crlf:
        new_text = new_text.replace("\n", "\r\n")
    encode_text(new_text)
    return new_text, snippet


def insert(text: str, insert_line: int, new_text: str, path: str) -> tuple[str, str]:
    """Insert ``new_text`` as whole lines after line ``insert_line`` (0: before the first line).

    One trailing newline of ``new_text`` is ignored (inserting ``"x"`` and ``"x\\n"``
    give the same result); an empty ``new_text`` inserts one empty line. The
    file keeps its trailing-newline behaviour: appending to a file that does not
    end with a newline gives a file that does not either. Returns
    ``(new_file_text, snippet)``.
    """
    if not isinstance(insert_line, int) or isinstance(insert_line, bool):
        raise InvalidInput(f"insert_line must be an integer, got {insert_line!r}")
    if not isinstance(new_text, str):
        raise InvalidInput(f"the text to insert must be a string, got {type(new_text).__name__}")
    crlf = _is_crlf(text)
    if crlf:
        text = text.replace("\r\n", "\n")
        new_text = new_text.replace("\r\n", "\n")
    lines = _split_lines(text)
    total = len(lines)
    if not 0 <= insert_line <= total:
        raise InvalidInput(
            f"insert_line {insert_line} is out of range: the file {path} has {total} lines; use a value "
            f"from 0 (before the first line) to {total} (after the last line)"
        )
    block = new_text[:-1] if new_text.endswith("\n") else new_text
    if insert_line == total and text and not text.endswith("\n"):
        result = text + "\n" + block
    else:
        offset = len("\n".join(lines[:insert_line])) + 1 if insert_line else 0
        result = text[:offset] + block + "\n" + text[offset:]
    snippet = _snippet(result, insert_line + 1, insert_line + block.count("\n") + 1)
    if crlf:
        result = result.replace("\n", "\r\n")
    encode_text(result)
    return result, snippet
