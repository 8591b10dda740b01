"""Bounded capture of a container's output from its attach stream: stdout kept up to a cap, stderr as head and tail."""

from __future__ import annotations

import contextlib
import socket as _socket
import threading
from collections.abc import Callable
from typing import Any

from docker.utils.socket import frames_iter as _frames_iter

EXCERPT_HEAD_BYTES = 64 * 1024
EXCERPT_TAIL_BYTES = 256 * 1024


class _Excerpt:
    """The first and the last bytes of a stream and its length: bounded memory whatever the stream does."""

    def __init__(self, *, head: int = EXCERPT_HEAD_BYTES, tail: int = EXCERPT_TAIL_BYTES) -> None:
        self._head_max, self._tail_max = head, tail
        self.head, self.tail, self.total = bytearray(), bytearray(), 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self._head_max - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 2 * self._tail_max:
                del self.tail[: -self._tail_max]

    def text(self) -> str:
        tail = bytes(self.tail[-self._tail_max:]) if self._tail_max else b""
        skipped = self.total - len(self.head) - len(tail)
        middle = f"\n[... {skipped} bytes not kept ...]\n" if skipped > 0 else ""
        return self.head.decode("utf-8", "replace") + middle + tail.decode("utf-8", "replace")


class OutputCapture:
    """A container's stdout and stderr, read from its attach stream on a thread, with hard bounds.

    stdout is kept whole (`keep_stdout`) up to `max_stdout` bytes; of stderr (and of stdout when
    not kept) only the head and tail are kept. A stream past its cap sets `overflow`, detaches
    and calls `on_overflow` (the adapter kills the container): memory never grows with what the
    container prints.
    """

    def __init__(self, *, max_stdout: int, max_stderr: int, keep_stdout: bool,
                 on_overflow: Callable[[], None] = lambda: None) -> None:
        self._limits = {1: max_stdout, 2: max_stderr}
        self._names = {1: "stdout", 2: "stderr"}
        self._streams = {1: _Excerpt(), 2: _Excerpt()}
        self._both = _Excerpt(head=0)
        self._kept: bytearray | None = bytearray() if keep_stdout else None
        self._on_overflow = on_overflow
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._sock = None
        self.overflow = ""
        self.error = ""

    def feed(self, stream: int, data: bytes) -> bool:
        """Take one chunk of `stream` (1 stdout, 2 stderr); False once a cap is broken (stop reading)."""
        if stream not in self._limits:
            return True
        with self._lock:
            excerpt = self._streams[stream]
            if excerpt.total + len(data) > self._limits[stream]:
                self.overflow = (f"{self._names[stream]} passed its cap of {self._limits[stream]} bytes "
                                 f"(the container was killed)")
                self._kept = None
                overflowed = True
            else:
                excerpt.add(data)
                self._both.add(data)
                if stream == 1 and self._kept is not None:
                    self._kept += data
                overflowed = False
        return not overflowed

    def start(self, sock: Any) -> None:
        """Read the attach socket `sock` (Docker's multiplexed frames) on a daemon thread until it ends."""
        self._sock = sock
        self._thread = threading.Thread(target=self._pump, name="skupin-capture", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        try:
            for stream, data in _frames_iter(self._sock, tty=False):
                if data and not self.feed(stream, bytes(data)):
                    # Detach first: a daemon blocked writing to a socket nobody reads would stall the kill.
                    self.close()
                    self._on_overflow()
                    break
        except Exception as exc:  # a broken stream ends the capture; the exit status says the rest
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.close()

    def join(self, timeout_s: float) -> bool:
        """Wait for the stream to end; True when it did."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            return not self._thread.is_alive()
        return True

    def close(self) -> None:
        """Stop reading: shut the attach socket down (wakes a blocked reader) and release its connection."""
        if self._sock is None:
            return
        raw = getattr(self._sock, "_sock", self._sock)
        with contextlib.suppress(OSError, AttributeError):
            raw.shutdown(_socket.SHUT_RDWR)
        for closable in (self._sock, getattr(self._sock, "_response", None)):
            with contextlib.suppress(Exception):
                closable.close()

    def stdout_bytes(self) -> bytes:
        with self._lock:
            return bytes(self._kept) if self._kept is not None else b""

    def text(self, *, stdout: bool = True, stderr: bool = True) -> str:
        """Head and tail of the chosen streams as text (both: the last bytes in arrival order)."""
        with self._lock:
            if stdout and stderr:
                return self._both.text()
            return self._streams[1 if stdout else 2].text() if (stdout or stderr) else ""
