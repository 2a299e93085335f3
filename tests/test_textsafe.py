"""Recording-derived text reaches the terminal escaped (a recording can carry escape sequences)."""

import pytest

from replay.textsafe import escape


@pytest.mark.parametrize(
    "raw, shown",
    [
        ("\x1b]0;title\x07", "\\x1b]0;title\\x07"),  # OSC title-set
        ("\x1b[2J\x1b[H", "\\x1b[2J\\x1b[H"),  # clear screen
        ("\x1b[32mbitwise equal\x1b[0m", "\\x1b[32mbitwise equal\\x1b[0m"),  # a faked green verdict
        ("abc\u202edcba", "abc\\u202edcba"),  # right-to-left override
        ("a\rb", "a\\x0db"),
        ("\x9b31m", "\\x9b31m"),  # C1 CSI
    ],
    ids=["osc", "clear", "colour", "bidi", "cr", "c1"],
)
def test_control_characters_are_escaped(raw: str, shown: str) -> None:
    assert escape(raw) == shown


def test_printable_text_is_unchanged() -> None:
    assert escape("layers.0.moe combine é 中 τ") == "layers.0.moe combine é 中 τ"
    assert escape("a\tb") == "a\tb"


def test_newlines_only_when_asked() -> None:
    assert escape("a\nb") == "a\\x0ab"
    assert escape("a\nb", keep_newlines=True) == "a\nb"


def test_error_lines_quote_recording_text_escaped(tmp_path, capsys) -> None:
    """An error line that quotes a path or name from the user or a recording cannot carry an
    escape sequence to the terminal."""
    from replay.cli.main import main

    code = main(["info", str(tmp_path / "no\x1b]0;title\x07such")])
    err = capsys.readouterr().err
    assert code != 0 and "\x1b" not in err and "\x07" not in err and "\\x1b]0;title\\x07" in err
