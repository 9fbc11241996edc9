"""The one escaping rule for text a sandbox, tenant or registry wrote, before a terminal
shows it (sbx_client.terminal)."""

from __future__ import annotations

import json
import unicodedata

from sbx_client import terminal

HOSTILE = (
    "ls\x1b[2J\x1b]0;owned\x07\rroot# rm -rf /\n12345 forged line\u202etxt.exe\x7f\x9b31m\u2028\u2066x\ud800"
)


def raw_controls(text: str) -> list[str]:
    return [c for c in text if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp", "Cs")]


def test_every_control_bidi_and_separator_character_is_shown_not_sent():
    shown = terminal.escape(HOSTILE)
    assert raw_controls(shown) == []
    assert shown == (
        "ls\\x1b[2J\\x1b]0;owned\\x07\\rroot# rm -rf /\\n12345 forged line\\u202etxt.exe\\x7f\\x9b31m"
        "\\u2028\\u2066x\\ud800"
    )


def test_ordinary_text_is_left_as_it_is():
    text = "grep -r 'naïve café' src/ | wc -l  # ünïcode, 中文, emoji 🎉, a\\nb"
    assert terminal.escape(text) == text


def test_json_for_a_terminal_is_ascii_and_parses_back_to_the_same_value():
    value = {"command": HOSTILE.replace("\ud800", ""), "n": 1}
    line = terminal.json_line(value)
    assert line.isascii() and raw_controls(line) == [] and "\x7f" not in line
    assert json.loads(line) == value
