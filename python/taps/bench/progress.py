"""Progress bars for long benchmark runs."""
from __future__ import annotations

import sys
import time


class Progress:
    """A progress bar on stderr: tqdm when installed, else one self-overwriting line; nothing when disabled.
    ``write`` prints a log line without breaking the bar."""

    def __init__(self, total: int, desc: str, unit: str = "it", enabled: bool = True, stream=None):
        self.stream = stream or sys.stderr
        self.total, self.desc, self.unit, self.enabled = int(total), desc, unit, bool(enabled)
        self.n = 0
        self._bar = None
        self._last = 0.0
        if not self.enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        # a log file gets a line every few seconds, not every update
        self._bar = tqdm(total=self.total, desc=desc, unit=unit, file=self.stream, leave=False, dynamic_ncols=True,
                         mininterval=0.1 if tty else 10.0)

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.enabled and time.monotonic() - self._last > 0.5:
            self._last = time.monotonic()
            self.stream.write(f"\r{self.desc}: {min(self.n, self.total)}/{self.total} {self.unit}\x1b[K")
            self.stream.flush()

    def write(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
            return
        prefix = "\r\x1b[K" if self.enabled and self.n else ""
        self.stream.write(prefix + line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            if not (hasattr(self.stream, "isatty") and self.stream.isatty()):
                self.stream.write("\n")  # a log file: the next line starts on its own line
        elif self.enabled and self.n:
            self.stream.write("\r\x1b[K")
            self.stream.flush()

