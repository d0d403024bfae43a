"""Assertions that several test files make."""

from __future__ import annotations


def one_line(excinfo, *needles: str) -> str:
    """The message of a raised error (pytest.raises' excinfo): one line holding every needle."""
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for needle in needles:
        assert needle in msg, msg
    return msg
