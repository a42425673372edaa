"""A real Kubernetes control plane for tests: upstream etcd, kube-apiserver,
kube-controller-manager and kube-scheduler on loopback, fake GPU nodes, and a node
simulator that runs this project's containers as local processes. See README.md."""

from .binaries import BinariesMissing, ensure_binaries, expected_bin_dir
from .handle import Cluster, start_cluster, wait_for
from .podspec import RUNNABLE_IMAGES

__all__ = ["BinariesMissing", "Cluster", "RUNNABLE_IMAGES", "ensure_binaries", "expected_bin_dir",
           "start_cluster", "wait_for"]
