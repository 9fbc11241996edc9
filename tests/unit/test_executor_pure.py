"""Pure parts of the executor: bounded output capture and rendering (services.executor.output)
and the parsing of a job poll's answer (services.executor.scripts.parse_poll)."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.executor import output, scripts
from services.executor.output import Capture

BINARY_NOTE = "[binary output: {n} bytes not shown; pipe it through `xxd | head` or `base64` to inspect]"
ESCAPE_NOTE = "\n[{n} byte(s) that are not UTF-8 text shown as \\xNN]"


def marker(dropped: int, total: int) -> str:
    return (
        f"\n[... output truncated: {dropped} of {total} bytes omitted; "
        "redirect to a file and view parts of it to see everything ...]\n"
    )


def captured(limit: int, *chunks: bytes) -> Capture:
    capture = Capture(limit)
    for chunk in chunks:
        capture.add(chunk)
    return capture


# ---- Capture ------------------------------------------------------------------------------


def test_empty_capture() -> None:
    capture = Capture(100)
    assert (capture.total, capture.truncated, capture.render()) == (0, False, "")


@pytest.mark.parametrize(
    "chunks", [[b"hello\nworld\n"], [b"hel", b"lo\n", b"", b"world\n"]], ids=["one", "many"]
)
def test_under_the_limit_keeps_everything(chunks: list[bytes]) -> None:
    capture = captured(100, *chunks)
    assert capture.render() == "hello\nworld\n"
    assert capture.total == 12 and not capture.truncated


def test_exactly_the_limit_is_not_truncated() -> None:
    data = bytes(range(65, 75))  # ABCDEFGHIJ
    capture = captured(10, data)
    assert (capture.total, capture.truncated, capture.render()) == (10, False, "ABCDEFGHIJ")
    capture.add(b"K")
    assert capture.truncated
    assert capture.render() == "ABCDE" + marker(1, 11) + "GHIJK"


def test_over_the_limit_keeps_head_and_tail() -> None:
    data = b"".join(b"line %04d\n" % i for i in range(1000))  # 10_000 bytes
    capture = captured(100, data)
    assert capture.total == 10_000 and capture.truncated
    assert bytes(capture.head) == data[:50] and bytes(capture.tail) == data[-50:]
    assert capture.render() == data[:50].decode() + marker(9_900, 10_000) + data[-50:].decode()
    assert "9900 of 10000 bytes omitted" in capture.render()


def test_odd_limit_gives_the_extra_byte_to_the_tail() -> None:
    capture = captured(7, b"0123456789")
    assert (bytes(capture.head), bytes(capture.tail)) == (b"012", b"6789")
    assert capture.render() == "012" + marker(3, 10) + "6789"


def test_zero_limit_keeps_nothing_but_counts() -> None:
    capture = captured(0, b"abc", b"def")
    assert (bytes(capture.head), bytes(capture.tail), capture.total) == (b"", b"", 6)
    assert capture.render() == marker(6, 6)


def test_total_counts_every_byte_of_a_huge_stream() -> None:
    capture = Capture(64)
    for _ in range(1000):
        capture.add(b"x" * 1000)
    assert capture.total == 1_000_000
    assert len(capture.head) + len(capture.tail) == 64
    assert "999936 of 1000000 bytes omitted" in capture.render()


def test_binary_halves_render_as_notes() -> None:
    capture = captured(20, b"\x00" * 100)
    assert capture.render() == BINARY_NOTE.format(n=10) + marker(80, 100) + BINARY_NOTE.format(n=10)


def test_cut_inside_a_utf8_character_renders_an_escape() -> None:
    capture = captured(9, "é".encode() * 10)  # head keeps 4 bytes = 2 chars, tail 5 bytes = half + 2 chars
    assert capture.render() == "éé" + marker(11, 20) + "\\xa9éé" + ESCAPE_NOTE.format(n=1)


@st.composite
def chunked(draw: st.DrawFn) -> tuple[bytes, list[bytes]]:
    data = draw(st.binary(max_size=300))
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=20)))
    bounds = [0, *cuts, len(data)]
    return data, [data[a:b] for a, b in itertools.pairwise(bounds)]


@given(chunked(), st.integers(0, 120))
def test_chunking_never_changes_the_result(sample: tuple[bytes, list[bytes]], limit: int) -> None:
    data, chunks = sample
    whole, pieces = captured(limit, data), captured(limit, *chunks)
    assert (pieces.head, pieces.tail, pieces.total) == (whole.head, whole.tail, whole.total)
    assert pieces.truncated == whole.truncated
    assert pieces.render() == whole.render()
    # and what is kept is exactly the head and the tail of the stream
    half = limit // 2
    assert whole.total == len(data)
    if len(data) <= limit:
        assert not whole.truncated and bytes(whole.head + whole.tail) == data
    else:
        assert whole.truncated
        assert bytes(whole.head) == data[:half]
        assert bytes(whole.tail) == data[len(data) - (limit - half) :]
        assert f"{len(data) - limit} of {len(data)} bytes omitted" in whole.render()


# ---- text -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    ["", "plain ascii\n", "héllo wörld ✓ 日本語 🙂\n", "tabs\tand\r\nCRLF\n", "\x1b[31mred\x1b[0m"],
    ids=["empty", "ascii", "unicode", "crlf", "ansi"],
)
def test_text_passes_utf8_through(value: str) -> None:
    assert output.text(value.encode()) == value


def test_a_binary_file_is_a_note() -> None:
    data = b"\x7fELF\x02\x01\x01\x00" + b"\x00" * 100
    assert output.text(data) == BINARY_NOTE.format(n=len(data))


@pytest.mark.parametrize(
    "data",
    [bytes(range(128, 256)), b"\xff" * 9, b"ok " + b"\xfe\xff" * 50, b"a" * 1000 + b"\xff" * 200],
    ids=["high-bytes", "nine-invalid", "mostly-invalid", "over-a-tenth"],
)
def test_text_mostly_undecodable_is_binary(data: bytes) -> None:
    assert output.text(data) == BINARY_NOTE.format(n=len(data))


@pytest.mark.parametrize(
    ("data", "want"),
    [
        (b"\x00", "\\x00"),
        (b"text with a NUL\x00 in the middle", "text with a NUL\\x00 in the middle"),
        (b"a\x00b\x00", "a\\x00b\\x00"),  # find -print0
        (b"caf\xe9 au lait", "caf\\xe9 au lait"),
        (b"\xff" * 8, "\\xff" * 8),
        (b"a" * 1000 + b"\xff" * 50, "a" * 1000 + "\\xff" * 50),
        ("naïve".encode()[:3] + b"\n", "na\\xc3\n"),  # a cut multi-byte character
    ],
    ids=["nul", "nul-in-text", "print0", "latin1-byte", "eight-invalid", "under-a-tenth", "cut-character"],
)
def test_text_with_a_few_odd_bytes_escapes_them_faithfully(data: bytes, want: str) -> None:
    assert output.text(data) == want + ESCAPE_NOTE.format(n=want.count("\\x"))


def test_text_with_literal_replacement_characters_is_still_text() -> None:
    value = "decoded badly upstream: " + "\ufffd" * 20 + "\n"
    assert output.text(value.encode()) == value


@given(st.text())
def test_text_round_trips_any_nul_free_text_without_replacements(value: str) -> None:
    value = value.replace("\x00", "").replace("\ufffd", "")
    assert output.text(value.encode()) == value


@given(st.binary(max_size=500))
def test_text_never_raises(data: bytes) -> None:
    rendered = output.text(data)
    rendered.encode()  # valid text: no NUL, no lone surrogate
    assert "\x00" not in rendered


# ---- tail_note ------------------------------------------------------------------------


def test_tail_note_when_only_the_tail_is_shown() -> None:
    assert output.tail_note(10_000, 512) == "[... showing the last 512 of 10000 bytes ...]\n"


@pytest.mark.parametrize(("total", "shown"), [(0, 0), (512, 512), (3, 5)])
def test_tail_note_is_empty_when_everything_is_shown(total: int, shown: int) -> None:
    assert output.tail_note(total, shown) == ""


# ---- parse_poll -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "status", "code", "total", "tail"),
    [
        (b"running\n0\n", "running", None, 0, b""),
        (b"running\n5\nhello", "running", None, 5, b"hello"),
        (b"exited 3\n12\nhello world\n", "exited", 3, 12, b"hello world\n"),
        (b"exited 0\n0\n", "exited", 0, 0, b""),
        (b"exited 137\n4\nkill", "exited", 137, 4, b"kill"),
        (b"exited\n0\n", "exited", None, 0, b""),
        (b"exited x\n0\n", "exited", None, 0, b""),
        (b"stopped\n2048\n...last bytes", "stopped", None, 2048, b"...last bytes"),
        (b"lost\n7\npartial", "lost", None, 7, b"partial"),
        (b"nojob\n", "nojob", None, 0, b""),
        (b"nojob", "nojob", None, 0, b""),
        (b"running 5\n0\n", "running", None, 0, b""),  # only an exited job has a code
        (b"exited 3\n      12\nhello world\n", "exited", 3, 12, b"hello world\n"),  # padded wc
        (b"exited 3\r\n12\r\nhi\r\n", "exited", 3, 12, b"hi\r\n"),
    ],
)
def test_parse_poll(raw: bytes, status: str, code: int | None, total: int, tail: bytes) -> None:
    assert scripts.parse_poll(raw) == scripts.JobReport(status, code, total, tail)


def test_parse_poll_keeps_newlines_and_binary_after_the_header() -> None:
    body = b"line 1\n\nline 3\r\n\x00\xff\xfe binary \x1b[0m\nexited 9\n42\n"
    report = scripts.parse_poll(b"exited 1\n%d\n" % len(body) + body)
    assert report == scripts.JobReport("exited", 1, len(body), body)


@pytest.mark.parametrize(
    ("raw", "total"),
    [(b"running\n\nabc", 3), (b"running\nmany\nabcd", 4), (b"running\n-1\nab", 2), (b"running", 0)],
    ids=["empty", "word", "negative", "no-size-line"],
)
def test_parse_poll_without_a_usable_size_counts_the_tail(raw: bytes, total: int) -> None:
    report = scripts.parse_poll(raw)
    assert (report.status, report.total_bytes) == ("running", total)


@pytest.mark.parametrize("raw", [b"", b"\n", b"\n\n", b"   \n0\n", b"\t\nxyz"], ids=repr)
def test_parse_poll_without_a_status_is_lost(raw: bytes) -> None:
    report = scripts.parse_poll(raw)
    assert report.status == "lost" and report.exit_code is None


@given(st.binary(max_size=200))
def test_parse_poll_never_raises_on_garbage(raw: bytes) -> None:
    report = scripts.parse_poll(raw)
    assert report.total_bytes >= 0
    assert report.exit_code is None or report.status == "exited"
    assert raw.endswith(report.tail)


@given(
    st.sampled_from(["running", "exited", "stopped", "lost"]),
    st.integers(0, 255),
    st.integers(0, 10**12),
    st.binary(max_size=100),
)
def test_parse_poll_reads_what_job_poll_writes(status: str, rc: int, total: int, tail: bytes) -> None:
    header = f"exited {rc}" if status == "exited" else status
    report = scripts.parse_poll(f"{header}\n{total}\n".encode() + tail)
    assert report == scripts.JobReport(status, rc if status == "exited" else None, total, tail)


KNOWN_STATUSES = {"running", "exited", "stopped", "lost", "nojob"}


@pytest.mark.parametrize("raw", [b"garbage", b"Segmentation fault\n0\n", b"\xff\xfe\n0\n"], ids=repr)
def test_parse_poll_maps_unknown_status_to_lost(raw: bytes) -> None:
    assert scripts.parse_poll(raw).status in KNOWN_STATUSES


@pytest.mark.parametrize(
    "raw", [b"exited --5\n0\n", "exited ²\n0\n".encode()], ids=["double-minus", "superscript"]
)
def test_parse_poll_never_raises_on_a_bad_exit_code(raw: bytes) -> None:
    report = scripts.parse_poll(raw)
    assert report.status == "exited" and report.exit_code is None


# ---- JOB_POLL itself, run by a local sh against a fake job directory ----------------------


@pytest.fixture
def jobs(tmp_path: Path) -> Path:
    # The executor's scripts run under sh and bash in sandboxes; the test host has both.
    assert shutil.which("sh") and shutil.which("bash"), "sh and bash are needed to run JOB_POLL"
    return tmp_path / "jobs"


def poll(jobs: Path, job: str, limit: int = 100) -> scripts.JobReport:
    script = scripts.JOB_POLL.replace(scripts.JOBS, str(jobs))
    # The executor reads only stdout and ignores the exit status of a poll (with no output file
    # yet, wc and tail complain on stderr and the script exits 1).
    done = subprocess.run(scripts.argv(script, job, str(limit)), capture_output=True, timeout=10)
    return scripts.parse_poll(done.stdout)


def make_job(jobs: Path, job: str, out: bytes | None, **files: str) -> None:
    path = jobs / job
    path.mkdir(parents=True)
    if out is not None:
        (path / "out").write_bytes(out)
    for name, content in files.items():
        (path / name).write_text(content)


def test_job_poll_script_nojob(jobs: Path) -> None:
    assert poll(jobs, "missing") == scripts.JobReport("nojob", None, 0, b"")


def test_job_poll_script_exited_with_tail(jobs: Path) -> None:
    out = b"".join(b"%d\n" % i for i in range(100)) + b"\x00\xff end"
    make_job(jobs, "j1", out, rc="3\n", pgid="1\n")
    assert poll(jobs, "j1", 16) == scripts.JobReport("exited", 3, len(out), out[-16:])


def test_job_poll_script_running(jobs: Path) -> None:
    make_job(jobs, "j2", b"working\n", pgid=f"{os.getpid()}\n")
    assert poll(jobs, "j2") == scripts.JobReport("running", None, 8, b"working\n")


def test_job_poll_script_stopped(jobs: Path) -> None:
    make_job(jobs, "j3", b"", stopped="", pgid="1\n")
    assert poll(jobs, "j3") == scripts.JobReport("stopped", None, 0, b"")


def test_job_poll_script_lost_without_output(jobs: Path) -> None:
    make_job(jobs, "j4", None, pgid="")
    assert poll(jobs, "j4") == scripts.JobReport("lost", None, 0, b"")


def test_a_directory_view_parses_its_first_lines_only() -> None:
    """The edit tool's directory view comes from the sandbox's own ``find | head``: a
    replaced ``head`` printing millions of lines yields DIR_ENTRIES entries, no more."""
    flood = b"d sub\nf file\n" * 2_000_000 + b"f last\n"
    entries = scripts.parse_directory(flood)
    assert len(entries) == scripts.DIR_ENTRIES
    assert entries[:2] == [("sub", "dir"), ("file", "file")]
    assert scripts.parse_directory(b"d a\nx junk\nf b\n\nf \xff\n") == [
        ("a", "dir"),
        ("b", "file"),
        ("\ufffd", "file"),
    ]
