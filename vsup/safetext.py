"""Text vsup did not write (an instance's output and errors, a server's answer, a results file) made
safe to show: every character that could steer a terminal, a log line or the reading direction
becomes a visible escape, so the text is shown as it is and does nothing.

Replaced by `\\xNN` / `\\uNNNN`: C0 controls but tab (and newline where a field is multi-line),
DEL and C1 controls — ESC among them, so no escape sequence (window title, clear screen,
hyperlink) survives —, the Unicode line and paragraph separators, the bidi embeddings, overrides
and isolates (U+202A-202E, U+2066-2069) and lone surrogates (they cannot be written out).
Everything else, UTF-8 text included, stays. Rich markup is another matter: build `rich.text.Text`
from this text (Text never parses markup) rather than passing a str where rich reads markup.
"""

from __future__ import annotations

import logging
import re

_UNSAFE = "\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff"
_ONE_LINE = re.compile(f"[\n{_UNSAFE}]")
_MULTI_LINE = re.compile(f"[{_UNSAFE}]")


def _visible(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: object, *, newlines: bool = False) -> str:
    """`text` (str() of it) with the characters above replaced by visible escapes; `newlines`
    keeps "\\n" for a field shown on several lines."""
    return (_MULTI_LINE if newlines else _ONE_LINE).sub(_visible, str(text))


class PrintableFormatter(logging.Formatter):
    """A log formatter whose message is `printable`: one record stays one line of plain text
    however much instance output or upstream text it carries (a traceback keeps its lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        record.message = printable(record.message)
        return super().formatMessage(record)
