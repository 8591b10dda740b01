"""Run a function on a thread and fail the test (not hang it) when it has not returned in time."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def finishes(fn: Callable[[], T], within: float = 60.0) -> T:
    """fn()'s result, or an assertion failure when it has not returned after `within` seconds.

    A generous bound that only a hang, a deadlock or a quadratic blow-up misses; speed targets live in bench/.
    """
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(within)
    assert not thread.is_alive(), f"not done after {within} s (hung, deadlocked or quadratic)"
    if "error" in box:
        raise box["error"]
    return box["value"]
