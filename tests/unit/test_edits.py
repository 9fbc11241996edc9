"""The pure text-editor semantics the executor applies to sandbox files (services.executor.edits).

Covers view (ranges, bounds, truncation, directories), binary and size checks,
str_replace (zero/one/many matches, deletion, unicode, CRLF), insert (positions,
trailing newlines, CRLF), path validation, and a replace-and-back round-trip property.
"""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from sbx_api.errors import InvalidInput
from services.executor import edits
from services.executor.edits import (
    MAX_FILE_BYTES,
    MAX_VIEW_BYTES,
    create_file,
    decode_text,
    edit_message,
    encode_text,
    insert,
    str_replace,
    view_directory,
    view_file,
)
from shared.contract.checks import path as validate_path

P = "/workspace/app.py"
FIVE = "one\ntwo\nthree\nfour\nfive\n"


def numbered(first: int, *lines: str) -> str:
    return "\n".join(f"{first + i:6}\t{line}" for i, line in enumerate(lines))


def test_constants() -> None:
    assert MAX_VIEW_BYTES == 256 * 1024
    assert MAX_FILE_BYTES == 10 * 1024 * 1024


# ---- validate_path -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given_path", "expected"),
    [
        ("/workspace/app.py", "/workspace/app.py"),
        ("/", "/"),
        ("//x", "/x"),
        ("///x//y/", "/x/y"),
        ("/a/./b/../c", "/a/c"),
        ("/../etc", "/etc"),
        ("/workspace/dir/", "/workspace/dir"),
    ],
)
def test_validate_path_normalises(given_path: str, expected: str) -> None:
    assert validate_path(given_path) == expected


@pytest.mark.parametrize("relative", ["app.py", "./app.py", "workspace/app.py", "../x", "~/x"])
def test_validate_path_rejects_relative(relative: str) -> None:
    with pytest.raises(InvalidInput) as info:
        validate_path(relative)
    assert info.value.message == "path must be absolute, e.g. /workspace/app.py"
    assert info.value.code == "invalid_input"


def test_validate_path_rejects_empty_nul_and_long() -> None:
    with pytest.raises(InvalidInput, match="must not be empty"):
        validate_path("")
    with pytest.raises(InvalidInput, match="NUL"):
        validate_path("/workspace/a\x00b")
    validate_path("/" + "a" * 4095)  # exactly 4096 characters is fine
    with pytest.raises(InvalidInput, match="4097 characters.*4096"):
        validate_path("/" + "a" * 4096)


def test_validate_path_rejects_non_string() -> None:
    with pytest.raises(InvalidInput, match="must be a string"):
        validate_path(None)  # type: ignore[arg-type]


# ---- decode / encode -----------------------------------------------------------------------


def test_decode_text_utf8() -> None:
    assert decode_text("héllo\tworld\n".encode(), P) == "héllo\tworld\n"
    assert decode_text(b"", P) == ""


def test_decode_text_rejects_nul_byte() -> None:
    data = b"abc\x00def"
    with pytest.raises(InvalidInput) as info:
        decode_text(data, P)
    message = info.value.message
    assert f"{P} looks like a binary file (7 bytes)" in message
    assert "NUL" in message
    assert "only handles" in message and "text files" in message
    assert "shell tool" in message


def test_decode_text_nul_after_sniff_window_is_text() -> None:
    data = b"a" * (8 * 1024) + b"\x00"
    assert decode_text(data, P) == "a" * (8 * 1024) + "\x00"


def test_decode_text_rejects_invalid_utf8() -> None:
    data = b"ok\n\xff\xfe"
    with pytest.raises(InvalidInput) as info:
        decode_text(data, P)
    message = info.value.message
    assert "looks like a binary file (5 bytes)" in message
    assert "not valid UTF-8 (at byte 3)" in message
    assert "shell tool" in message


def test_decode_text_size_limit() -> None:
    assert decode_text(b"a" * MAX_FILE_BYTES, P) == "a" * MAX_FILE_BYTES
    with pytest.raises(InvalidInput) as info:
        decode_text(b"a" * (MAX_FILE_BYTES + 1), P)
    assert f"{MAX_FILE_BYTES + 1} bytes" in info.value.message
    assert "shell tool" in info.value.message


def test_create_file_encodes_and_limits() -> None:
    assert create_file("héllo\n") == "héllo\n".encode()
    assert create_file("") == b""
    assert create_file("a" * MAX_FILE_BYTES) == b"a" * MAX_FILE_BYTES
    with pytest.raises(InvalidInput, match="larger than"):
        create_file("a" * (MAX_FILE_BYTES + 1))
    # Multibyte characters count in bytes, not characters.
    with pytest.raises(InvalidInput, match="larger than"):
        create_file("é" * (MAX_FILE_BYTES // 2 + 1))


def test_create_file_rejects_lone_surrogate() -> None:
    with pytest.raises(InvalidInput, match="cannot be encoded as UTF-8 at position 1"):
        create_file("a\ud800b")


def test_encode_decode_round_trip_keeps_bom_and_crlf() -> None:
    text = "\ufeffa\r\nb\r\n"
    assert decode_text(encode_text(text), P) == text


# ---- view_file -----------------------------------------------------------------------------


def test_view_whole_file() -> None:
    assert view_file(FIVE, P, None) == numbered(1, "one", "two", "three", "four", "five")


def test_view_exact_format() -> None:
    assert view_file("a\n\tb\n", P, None) == "     1\ta\n     2\t\tb"


def test_view_without_trailing_newline() -> None:
    assert view_file("a\nb", P, None) == numbered(1, "a", "b")


def test_view_keeps_blank_lines() -> None:
    assert view_file("a\n\n\nb\n", P, None) == numbered(1, "a", "", "", "b")
    assert view_file("\n", P, None) == numbered(1, "")


def test_view_does_not_expand_tabs() -> None:
    assert view_file("\tx\ty\n", P, None) == "     1\t\tx\ty"


def test_view_only_splits_on_newline() -> None:
    # Form feed, vertical tab and U+2028 are not line breaks for the tool.
    assert view_file("a\x0cb\x0bc\u2028d\n", P, None) == numbered(1, "a\x0cb\x0bc\u2028d")


def test_view_empty_file() -> None:
    assert view_file("", P, None) == f"[the file {P} is empty]"


def test_view_range() -> None:
    assert view_file(FIVE, P, [2, 4]) == numbered(2, "two", "three", "four")
    assert view_file(FIVE, P, [3, 3]) == numbered(3, "three")
    assert view_file(FIVE, P, [1, 5]) == view_file(FIVE, P, None)


def test_view_range_to_end() -> None:
    assert view_file(FIVE, P, [4, -1]) == numbered(4, "four", "five")
    assert view_file(FIVE, P, [5, -1]) == numbered(5, "five")
    assert view_file(FIVE, P, [1, -1]) == view_file(FIVE, P, None)


def test_view_range_accepts_tuple() -> None:
    assert view_file(FIVE, P, (2, 2)) == numbered(2, "two")


def test_view_range_out_of_bounds_message() -> None:
    with pytest.raises(InvalidInput) as info:
        view_file("a\nb\nc\n", P, [5, 9])
    assert info.value.message == (
        "view_range [5, 9] is out of bounds: the file has 3 lines; use [1, 3] or [1, -1]"
    )


@pytest.mark.parametrize(
    ("view_range", "reason"),
    [
        ([0, 2], "start must be at least 1"),
        ([-1, 2], "start must be at least 1"),
        ([6, -1], "out of bounds"),
        ([6, 7], "out of bounds"),
        ([3, 2], "end must be at least start"),
        ([2, -2], "end must be at least start"),
        ([1, 6], "out of bounds"),
    ],
)
def test_view_range_invalid(view_range: list[int], reason: str) -> None:
    with pytest.raises(InvalidInput) as info:
        view_file(FIVE, P, view_range)
    message = info.value.message
    assert message.startswith(f"view_range [{view_range[0]}, {view_range[1]}] is ")
    assert reason in message
    assert message.endswith("the file has 5 lines; use [1, 5] or [1, -1]")


@pytest.mark.parametrize("view_range", [[], [1], [1, 2, 3], ["1", "2"], [1.0, 2], [True, 2], "1,2", 3])
def test_view_range_wrong_shape(view_range: object) -> None:
    with pytest.raises(InvalidInput, match="exactly two integers"):
        view_file(FIVE, P, view_range)  # type: ignore[arg-type]


def test_view_range_on_empty_file() -> None:
    with pytest.raises(InvalidInput) as info:
        view_file("", P, [1, -1])
    assert info.value.message == (
        f"view_range [1, -1] cannot be used: the file {P} is empty (0 lines); view it without view_range"
    )


def test_view_truncates_large_output() -> None:
    line = "x" * 99
    total = 5000  # about 5000 * 107 bytes rendered, well over 256 KiB
    text = (line + "\n") * total
    out = view_file(text, P, None)
    marker = f"[... output truncated: file has {total} lines; use view_range to see more]"
    assert out.endswith("\n" + marker)
    assert len(out.encode()) <= MAX_VIEW_BYTES
    body = out.split("\n")[:-1]
    assert len(body) > 2000  # the budget is used, not wasted
    assert body == [f"{n:6}\t{line}" for n in range(1, len(body) + 1)]  # whole lines only
    # The rest is reachable with view_range.
    rest = view_file(text, P, [len(body) + 1, -1])
    assert rest.startswith(f"{len(body) + 1:6}\t{line}")


def test_view_just_under_limit_is_not_truncated() -> None:
    # Each rendered line is 6 + 1 + 9 = 16 bytes, plus 1 for the joining newline.
    lines = (MAX_VIEW_BYTES + 1) // 17
    out = view_file("a" * 9 + "\n" + ("b" * 9 + "\n") * (lines - 1), P, None)
    assert "truncated" not in out
    assert len(out.encode()) <= MAX_VIEW_BYTES
    assert out.count("\n") == lines - 1


def test_view_truncates_single_huge_line() -> None:
    text = "é" * MAX_VIEW_BYTES + "\nsecond\n"
    out = view_file(text, P, None)
    assert out.startswith("     1\téé")
    assert out.endswith("\n[... output truncated: file has 2 lines; use view_range to see more]")
    assert len(out.encode()) <= MAX_VIEW_BYTES
    assert view_file(text, P, [2, 2]) == numbered(2, "second")


# ---- view_directory ------------------------------------------------------------------------


def test_view_directory() -> None:
    entries = [
        ("src", "dir"),
        ("README.md", "file"),
        ("src/app.py", "file"),
        ("src/lib", "dir"),
        ("a.txt", "file"),
        ("a", "dir"),
        ("a/b", "file"),
    ]
    assert view_directory(entries, "/workspace") == "\n".join(
        [
            "Here are the files and directories up to 2 levels deep in /workspace, excluding hidden items:",
            "/workspace/README.md",
            "/workspace/a/",
            "/workspace/a/b",
            "/workspace/a.txt",
            "/workspace/src/",
            "/workspace/src/app.py",
            "/workspace/src/lib/",
        ]
    )


def test_view_directory_root_and_empty() -> None:
    assert view_directory([("etc", "dir")], "/") == (
        "Here are the files and directories up to 2 levels deep in /, excluding hidden items:\n/etc/"
    )
    assert view_directory([], "/w") == (
        "Here are the files and directories up to 2 levels deep in /w, excluding hidden items:\n"
        "[the directory is empty]"
    )


def test_view_directory_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError, match="'link'"):
        view_directory([("x", "link")], "/w")


def test_view_directory_truncates() -> None:
    entries = [(f"d{i:02}/{'f' * 200}{j:04}", "file") for i in range(10) for j in range(300)]
    out = view_directory(entries, "/workspace")
    assert len(out.encode()) <= MAX_VIEW_BYTES
    assert out.endswith("\n[... output truncated: 3000 entries; view a subdirectory to see more]")
    lines = out.split("\n")
    assert lines[1] == f"/workspace/d00/{'f' * 200}0000"
    assert len(lines) > 1000


# ---- str_replace ---------------------------------------------------------------------------


def test_str_replace_single_match() -> None:
    new_text, snippet = str_replace(FIVE, "three", "THREE", P)
    assert new_text == "one\ntwo\nTHREE\nfour\nfive\n"
    assert snippet == numbered(1, "one", "two", "THREE", "four", "five")


def test_str_replace_snippet_has_four_lines_of_context() -> None:
    text = "".join(f"line {n}\n" for n in range(1, 21))
    new_text, snippet = str_replace(text, "line 10\n", "ten\nTEN\n", P)
    assert new_text.split("\n")[8:12] == ["line 9", "ten", "TEN", "line 11"]
    assert snippet == numbered(
        6, "line 6", "line 7", "line 8", "line 9", "ten", "TEN", "line 11", "line 12", "line 13", "line 14"
    )
    # Mid-line edits that add a newline show the split line's tail as edited.
    _, snippet = str_replace(text, "line 10", "li\nne 10", P)
    assert snippet.split("\n")[0] == "     6\tline 6"
    assert snippet.split("\n")[-1] == "    15\tline 14"


def test_str_replace_multiline_old_str() -> None:
    new_text, _ = str_replace(FIVE, "two\nthree\n", "", P)
    assert new_text == "one\nfour\nfive\n"


def test_str_replace_zero_matches() -> None:
    with pytest.raises(InvalidInput) as info:
        str_replace(FIVE, "seven", "7", P)
    message = info.value.message
    assert message.startswith(f"No replacement was performed, old_str did not appear verbatim in {P}.")
    assert "whitespace" in message
    assert "similar text" not in message


def test_str_replace_zero_matches_whitespace_hint() -> None:
    text = "def f():\n    if x:\n        return 1\n"
    with pytest.raises(InvalidInput) as info:
        str_replace(text, "if x:\n    return 1", "if y:\n    return 2", P)
    assert "A similar text exists with different whitespace" in info.value.message
    assert "at line 2" in info.value.message


def test_str_replace_zero_matches_hint_for_tabs_and_trailing_spaces() -> None:
    text = "a\nb\n\tvalue = 1  \nc\n"
    with pytest.raises(InvalidInput, match="at line 3"):
        str_replace(text, "    value = 1", "value = 2", P)


def test_str_replace_case_is_not_whitespace() -> None:
    with pytest.raises(InvalidInput) as info:
        str_replace(FIVE, "THREE", "3", P)
    assert "similar text" not in info.value.message


def test_str_replace_multiple_matches_reports_lines() -> None:
    text = "a\nb\nx = 1\nc\nd\ne\nf\ng\nx = 1\n"
    with pytest.raises(InvalidInput) as info:
        str_replace(text, "x = 1", "x = 2", P)
    assert info.value.message.startswith(
        "No replacement was performed. Multiple occurrences of old_str in lines [3, 9]. "
        "Please ensure it is unique"
    )


def test_str_replace_multiple_matches_on_one_line_and_multiline() -> None:
    with pytest.raises(InvalidInput, match=r"in lines \[2\]\."):
        str_replace("a\nfoo foo\n", "foo", "bar", P)
    with pytest.raises(InvalidInput, match=r"in lines \[1, 3\]\."):
        str_replace("a\nb\na\nb\n", "a\nb", "c", P)


def test_str_replace_overlapping_matches_are_ambiguous() -> None:
    with pytest.raises(InvalidInput, match=r"Multiple occurrences of old_str in lines \[1\]"):
        str_replace("aaa\n", "aa", "b", P)


def test_str_replace_many_matches_are_capped() -> None:
    text = "x\n" * 500
    with pytest.raises(InvalidInput) as info:
        str_replace(text, "x", "y", P)
    message = info.value.message
    assert f"in lines {list(range(1, 101))} and more." in message


def test_str_replace_deletion_with_none() -> None:
    new_text, snippet = str_replace(FIVE, "two\n", None, P)
    assert new_text == "one\nthree\nfour\nfive\n"
    assert snippet == numbered(1, "one", "three", "four", "five")
    new_text, _ = str_replace("keep this", " this", None, P)
    assert new_text == "keep"


def test_str_replace_delete_everything() -> None:
    new_text, snippet = str_replace("only\n", "only\n", "", P)
    assert new_text == ""
    assert snippet == ""


def test_str_replace_rejects_empty_old_str() -> None:
    with pytest.raises(InvalidInput, match="old_str must be a non-empty string"):
        str_replace(FIVE, "", "x", P)


def test_str_replace_rejects_identical_strings() -> None:
    with pytest.raises(InvalidInput, match="identical"):
        str_replace(FIVE, "two", "two", P)


def test_str_replace_unicode() -> None:
    text = "naïve = '☃'\nemoji = '🐍'\n"
    new_text, snippet = str_replace(text, "'🐍'", "'🦀 crab'", P)
    assert new_text == "naïve = '☃'\nemoji = '🦀 crab'\n"
    assert snippet == numbered(1, "naïve = '☃'", "emoji = '🦀 crab'")


def test_str_replace_keeps_tabs() -> None:
    new_text, snippet = str_replace("if x:\n\treturn 1\n", "\treturn 1", "\treturn\t2", P)
    assert new_text == "if x:\n\treturn\t2\n"
    assert snippet == "     1\tif x:\n     2\t\treturn\t2"


def test_str_replace_crlf_file() -> None:
    text = "one\r\ntwo\r\nthree\r\n"
    # old_str copied from view has "\n" line endings; new lines get "\r\n".
    new_text, snippet = str_replace(text, "one\ntwo\n", "uno\ndos\nzwei\n", P)
    assert new_text == "uno\r\ndos\r\nzwei\r\nthree\r\n"
    assert snippet == numbered(1, "uno", "dos", "zwei", "three")
    # old_str given with "\r\n" works too.
    new_text, _ = str_replace(text, "two\r\nthree", "2\r\n3", P)
    assert new_text == "one\r\n2\r\n3\r\n"


def test_view_crlf_file_hides_carriage_returns() -> None:
    assert view_file("a\r\nb\r\n", P, None) == numbered(1, "a", "b")


def test_mixed_line_endings_are_verbatim() -> None:
    text = "a\r\nb\nc\n"
    assert view_file(text, P, None) == numbered(1, "a\r", "b", "c")
    new_text, _ = str_replace(text, "b\n", "B\n", P)
    assert new_text == "a\r\nB\nc\n"


def test_str_replace_result_size_limit() -> None:
    with pytest.raises(InvalidInput, match="larger than"):
        str_replace("x\n", "x", "y" * (MAX_FILE_BYTES + 1), P)


def test_edit_message() -> None:
    assert edit_message(P, "     1\tx") == (
        f"The file {P} has been edited. Here's the result of running `cat -n` on a snippet of {P}:\n"
        "     1\tx\n"
        "Review the changes and make sure they are as expected. Edit the file again if necessary."
    )


# ---- insert --------------------------------------------------------------------------------


@pytest.mark.parametrize("new_text", ["x", "x\n"])
def test_insert_middle(new_text: str) -> None:
    result, snippet = insert("a\nb\n", 1, new_text, P)
    assert result == "a\nx\nb\n"
    assert snippet == numbered(1, "a", "x", "b")


def test_insert_at_beginning() -> None:
    result, snippet = insert("a\nb\n", 0, "x", P)
    assert result == "x\na\nb\n"
    assert snippet == numbered(1, "x", "a", "b")


def test_insert_at_end() -> None:
    assert insert("a\nb\n", 2, "x", P)[0] == "a\nb\nx\n"
    assert insert("a\nb\n", 2, "x\n", P)[0] == "a\nb\nx\n"


def test_insert_at_end_without_trailing_newline() -> None:
    result, snippet = insert("a\nb", 2, "x", P)
    assert result == "a\nb\nx"
    assert snippet == numbered(1, "a", "b", "x")
    assert insert("a\nb", 2, "x\ny\n", P)[0] == "a\nb\nx\ny"


def test_insert_before_end_without_trailing_newline() -> None:
    assert insert("a\nb", 1, "x", P)[0] == "a\nx\nb"
    assert insert("a\nb", 0, "x", P)[0] == "x\na\nb"


def test_insert_multiple_lines_and_blank_lines() -> None:
    result, snippet = insert("a\nb\n", 1, "x\n\ny\n", P)
    assert result == "a\nx\n\ny\nb\n"
    assert snippet == numbered(1, "a", "x", "", "y", "b")
    # Only one trailing newline is dropped: a deliberate blank line survives.
    assert insert("a\nb\n", 1, "x\n\n", P)[0] == "a\nx\n\nb\n"
    # Empty text inserts one empty line.
    assert insert("a\nb\n", 1, "", P)[0] == "a\n\nb\n"


def test_insert_into_empty_file() -> None:
    result, snippet = insert("", 0, "hello", P)
    assert result == "hello\n"
    assert snippet == numbered(1, "hello")


def test_insert_snippet_context() -> None:
    text = "".join(f"{n}\n" for n in range(1, 21))
    _, snippet = insert(text, 10, "new", P)
    assert snippet == numbered(7, "7", "8", "9", "10", "new", "11", "12", "13", "14")


def test_insert_keeps_tabs_and_unicode() -> None:
    result, _ = insert("def f():\n\tpass\n", 1, "\t# ünïcode ☃", P)
    assert result == "def f():\n\t# ünïcode ☃\n\tpass\n"


@pytest.mark.parametrize("line", [-1, 3, 100])
def test_insert_out_of_range(line: int) -> None:
    with pytest.raises(InvalidInput) as info:
        insert("a\nb\n", line, "x", P)
    assert info.value.message == (
        f"insert_line {line} is out of range: the file {P} has 2 lines; use a value from 0 "
        "(before the first line) to 2 (after the last line)"
    )


def test_insert_out_of_range_on_empty_file() -> None:
    with pytest.raises(InvalidInput, match="has 0 lines; use a value from 0 .* to 0"):
        insert("", 1, "x", P)


@pytest.mark.parametrize("line", ["1", 1.0, True, None])
def test_insert_line_must_be_int(line: object) -> None:
    with pytest.raises(InvalidInput, match="insert_line must be an integer"):
        insert("a\n", line, "x", P)  # type: ignore[arg-type]


def test_insert_crlf_file() -> None:
    result, snippet = insert("a\r\nb\r\n", 1, "x\ny", P)
    assert result == "a\r\nx\r\ny\r\nb\r\n"
    assert snippet == numbered(1, "a", "x", "y", "b")
    assert insert("a\r\nb\r\n", 2, "x\r\n", P)[0] == "a\r\nb\r\nx\r\n"
    assert insert("a\r\nb", 2, "x", P)[0] == "a\r\nb\r\nx"


def test_insert_result_size_limit() -> None:
    with pytest.raises(InvalidInput, match="larger than"):
        insert("a\n", 1, "y" * MAX_FILE_BYTES, P)


# ---- properties ----------------------------------------------------------------------------

# No "\r" here: a file is either LF (this alphabet) or CRLF (built line by line below).
_chars = st.sampled_from([*"ab \t\n", "é", "☃", "🐍"])
_line_chars = st.sampled_from([*"ab \t", "é", "🐍"])


def _unique(text: str, needle: str) -> bool:
    return len(edits._find_occurrences(text, needle, 2)) == 1


def _substring(data: st.DataObject, text: str) -> tuple[int, int]:
    start = data.draw(st.integers(0, len(text) - 1))
    length = data.draw(st.integers(1, min(12, len(text) - start)))
    return start, length


@given(
    text=st.text(alphabet=_chars, min_size=1, max_size=60),
    new_str=st.text(alphabet=_chars, min_size=1, max_size=12),
    data=st.data(),
)
def test_str_replace_round_trip(text: str, new_str: str, data: st.DataObject) -> None:
    start, length = _substring(data, text)
    old_str = text[start : start + length]
    assume(_unique(text, old_str) and new_str != old_str)
    replaced, _ = str_replace(text, old_str, new_str, P)
    assert replaced == text[:start] + new_str + text[start + length :]
    assume(_unique(replaced, new_str))
    restored, _ = str_replace(replaced, new_str, old_str, P)
    assert restored == text


@given(
    lines=st.lists(st.text(alphabet=_line_chars, max_size=8), min_size=2, max_size=8),
    new_str=st.text(alphabet=_chars, min_size=1, max_size=12),
    data=st.data(),
)
def test_str_replace_round_trip_crlf(lines: list[str], new_str: str, data: st.DataObject) -> None:
    text = "\r\n".join(lines) + "\r\n"
    lf_text = text.replace("\r\n", "\n")
    start, length = _substring(data, lf_text)
    old_str = lf_text[start : start + length]  # as copied from view
    assume(_unique(lf_text, old_str) and new_str != old_str)
    replaced, _ = str_replace(text, old_str, new_str, P)
    assert replaced == (lf_text[:start] + new_str + lf_text[start + length :]).replace("\n", "\r\n")
    assert "\n" not in replaced.replace("\r\n", "")  # line endings stay CRLF
    assume(edits._is_crlf(replaced) and _unique(replaced.replace("\r\n", "\n"), new_str))
    restored, _ = str_replace(replaced, new_str, old_str, P)
    assert restored == text


@given(
    lines=st.lists(st.text(alphabet=_line_chars, max_size=8), max_size=10),
    trailing=st.booleans(),
    data=st.data(),
)
def test_insert_adds_exactly_one_line(lines: list[str], trailing: bool, data: st.DataObject) -> None:
    text = "\n".join(lines) + ("\n" if trailing and lines else "")
    before = edits._split_lines(text)
    at = data.draw(st.integers(0, len(before)))
    result, snippet = insert(text, at, "NEW", P)
    assert edits._split_lines(result) == [*before[:at], "NEW", *before[at:]]
    assert result.endswith("\n") == (text.endswith("\n") or not text)
    assert f"{at + 1:6}\tNEW" in snippet.split("\n")
