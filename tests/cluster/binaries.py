"""Where the upstream binaries are, and building them (through build.sh) when absent."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BUILD_SCRIPT = Path(__file__).resolve().parent / "build.sh"
BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "etcd", "helm")


class BinariesMissing(RuntimeError):
    pass


def expected_bin_dir() -> Path:
    """The cache dir this checkout's pins map to (or $WEIGHTCACHE_K8S_BIN)."""
    out = subprocess.run(["bash", str(BUILD_SCRIPT), "--bin-dir"], check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def is_complete(bin_dir: Path) -> bool:
    return all(os.access(bin_dir / b, os.X_OK) for b in BINARIES)


def ensure_binaries(build: bool = True, progress=sys.stderr) -> Path:
    """The bin dir, built first if BUILD and it is incomplete. The build (15-20 min
    cold on 2 cores) streams its progress lines to PROGRESS."""
    bin_dir = expected_bin_dir()
    if is_complete(bin_dir):
        return bin_dir
    if os.environ.get("WEIGHTCACHE_K8S_BIN"):
        raise BinariesMissing(f"WEIGHTCACHE_K8S_BIN={bin_dir} lacks some of: {' '.join(BINARIES)}")
    if not build:
        raise BinariesMissing(f"control-plane binaries missing in {bin_dir}; run `make cluster-build`")
    print(f"building control-plane binaries into {bin_dir} (cold: about 15-20 min on 2 cores)", file=progress, flush=True)
    proc = subprocess.Popen(["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail = []
    for line in proc.stdout:
        tail = (tail + [line])[-30:]
        print(line, end="", file=progress, flush=True)
    if proc.wait() != 0 or not is_complete(bin_dir):
        raise BinariesMissing(f"building the control-plane binaries failed (status {proc.returncode}):\n"
                              + "".join(tail))
    return bin_dir
