"""Did-you-mean: the known value closest to a wrong one, for the fix of a problem (difflib)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(value: str, known: Iterable[str]) -> str:
    """"did you mean 'x'?" for the known value closest to `value`, or "" when none is close."""
    close = difflib.get_close_matches(str(value), [str(k) for k in known], n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else ""
