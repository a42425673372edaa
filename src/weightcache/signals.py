"""How every long-running weightcache command learns it should stop."""

import signal
import threading


def stop_on_signal() -> threading.Event:
    """An event SIGTERM and SIGINT set, for a main thread that waits on it and then
    shuts down in order (Kubernetes sends SIGTERM, then SIGKILL after the grace period)."""
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    return stop
