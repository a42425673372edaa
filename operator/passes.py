"""One pass at a time per object, with events folded in.

Handlers run on kopf's threads, one per event; two events of one object would run two
passes at once. Here the second caller only marks the object for one more pass, which
the caller already running makes after its own: an event storm costs a pass or two.
"""

from __future__ import annotations

import threading
from typing import Callable, Hashable


class SerialPasses:
    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._running: set[Hashable] = set()
        self._again: set[Hashable] = set()

    def run(self, key: Hashable, one_pass: Callable[[], bool]) -> None:
        """Run one_pass for KEY unless a pass of KEY is running (then it runs once more
        after it). one_pass returns True to ask for another pass itself (a lost race)."""
        with self._guard:
            if key in self._running:
                self._again.add(key)
                return
            self._running.add(key)
        try:
            while True:
                again = one_pass()
                with self._guard:
                    if not again and key not in self._again:
                        self._running.discard(key)
                        return
                    self._again.discard(key)
        except BaseException:
            with self._guard:
                self._running.discard(key)
                self._again.discard(key)
            raise
