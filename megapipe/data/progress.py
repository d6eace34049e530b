"""Progress of a streaming job in documents/s and MB/s: a tqdm bar on a terminal, else a log
line every --log-interval documents (as Megatron's preprocess_data.py prints)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Call `update(documents, num_bytes)` as work completes, then `close()`."""

    def __init__(
        self,
        total_bytes: int | None,
        log_interval: int = 1000,
        stream: TextIO | None = None,
        enabled: bool = True,
        bar: bool | None = None,  # None: a bar when the stream is a terminal
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.log_interval = max(1, log_interval)
        self.documents = 0
        self.bytes = 0
        self.start = time.perf_counter()
        self._next_log = self.log_interval
        self._bar = None
        if enabled and (bar if bar is not None else self.stream.isatty()):
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_bytes,
                unit="B",
                unit_scale=True,
                file=self.stream,
                desc="preprocess",
                dynamic_ncols=True,
            )

    def rates(self) -> tuple[float, float]:
        """(documents per second, megabytes per second) so far."""
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        return self.documents / elapsed, self.bytes / elapsed / 1e6

    def update(self, documents: int, num_bytes: int) -> None:
        self.documents += documents
        self.bytes += num_bytes
        if not self.enabled:
            return
        docs_per_s, mb_per_s = self.rates()
        if self._bar is not None:
            self._bar.update(num_bytes)
            self._bar.set_postfix_str(f"{self.documents} docs, {docs_per_s:.0f} docs/s")
        elif self.documents >= self._next_log:
            print(
                f"Processed {self.documents} documents ({docs_per_s:.1f} docs/s, "
                f"{mb_per_s:.2f} MB/s).",
                file=self.stream,
                flush=True,
            )
            while self._next_log <= self.documents:
                self._next_log += self.log_interval

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
