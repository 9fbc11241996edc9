"""The agent-host command line's pure parts (clients/python/sbx_client/cli.py): the upload
bar shows only for an upload worth waiting for, and goes away when it is done."""

from __future__ import annotations

import io

from rich.console import Console

from sbx_client.cli import UploadBar


def bar_output(calls: list[tuple[int, int]]) -> tuple[str, UploadBar]:
    out = io.StringIO()
    bar = UploadBar(Console(file=out, force_terminal=True, width=100))
    for sent, total in calls:
        bar("/work/project", sent, total)
    return out.getvalue(), bar


def test_a_large_upload_shows_a_bar_that_goes_away():
    total = UploadBar.MIN_BYTES * 2
    shown, bar = bar_output([(0, total), (total // 2, total), (total, total)])
    assert "syncing up project" in shown
    assert bar.bar is None  # stopped at the end


def test_a_small_upload_shows_nothing():
    shown, bar = bar_output([(0, 1000), (1000, 1000)])
    assert shown == "" and bar.bar is None


def test_close_stops_a_bar_left_running():
    total = UploadBar.MIN_BYTES * 2
    _, bar = bar_output([(0, total), (10, total)])
    assert bar.bar is not None
    bar.close()
    assert bar.bar is None
