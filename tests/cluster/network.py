"""The loopback addresses of one test cluster. Several clusters may run on one machine
(a developer's `make cluster-up` next to `make test`), so each supervisor claims a slot
with a lock file, held while it lives, and takes its own ranges from it:
ClusterIPs 127.(100+slot).0.0/16, pod IPs 127.(150+slot).x.y, node IPs 127.(200+slot).0.n."""

from __future__ import annotations

import fcntl
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

SLOTS = 50
SLOT_DIR = Path(tempfile.gettempdir()) / "weightcache-cluster-slots"


@dataclass(frozen=True)
class Network:
    slot: int

    @property
    def service_cidr(self) -> str:
        return f"127.{100 + self.slot}.0.0/16"

    @property
    def kubernetes_service_ip(self) -> str:
        """The first ClusterIP, which the apiserver gives the `kubernetes` Service."""
        return f"127.{100 + self.slot}.0.1"

    def pod_ip(self, n: int) -> str:
        """The Nth pod IP (n >= 0), never .0 or .1 in the last octet."""
        return f"127.{150 + self.slot}.{n // 250}.{n % 250 + 2}"

    def node_ip(self, index: int) -> str:
        """A node's InternalIP, also the pod IP of its hostNetwork pods."""
        return f"127.{200 + self.slot}.0.{index + 1}"


def claim_network(slot_dir: Path = SLOT_DIR) -> tuple[Network, int]:
    """A free slot and the fd whose lock holds it (released when the process ends)."""
    slot_dir.mkdir(parents=True, exist_ok=True)
    for slot in range(SLOTS):
        fd = os.open(slot_dir / f"slot-{slot}.lock", os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return Network(slot), fd
    raise RuntimeError(f"all {SLOTS} cluster slots in {slot_dir} are taken")
