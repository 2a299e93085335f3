"""Text from a recording, made safe for a terminal.

A recording is handed from person to person, so every string in it (the command, host names,
exception texts, field, tuner and graph names) is untrusted. Printed raw, an escape sequence in
it could set the terminal's title, clear the screen or colour a line to fake a verdict. Every
terminal output of recording-derived text goes through :func:`escape`; JSON output escapes
control characters by itself.
"""

from __future__ import annotations

import unicodedata

__all__ = ["escape", "a_or_an"]

# Characters that change how a terminal shows what follows, beyond the C0/C1 controls:
# bidirectional overrides and isolates can make text read in another order than it is.
_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _escaped(ch: str) -> str:
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def escape(text: object, *, keep_newlines: bool = False) -> str:
    """``text`` with every control character written as an escape (``\\x1b``, ``\\u202e``).

    Tabs are kept; newlines are kept only with ``keep_newlines`` (for multi-line blocks whose
    lines the caller lays out itself).
    """
    s = text if isinstance(text, str) else str(text)
    if s.isprintable():
        return s
    out = []
    for ch in s:
        if ch == "\t" or (keep_newlines and ch == "\n"):
            out.append(ch)
        elif ch in _BIDI or unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"):
            out.append(_escaped(ch))
        else:
            out.append(ch)
    return "".join(out)


def a_or_an(word: object) -> str:
    """``word`` with its indefinite article, by its first letter: "an EncoderDecoderCache"."""
    text = str(word)
    return f"{'an' if text[:1].lower() in 'aeiou' and text[:1] else 'a'} {text}"
