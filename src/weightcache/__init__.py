"""weightcache: a node-local GPU weight cache for LLM inference on Kubernetes.

Subpackages: weightcache.client (what engines import), weightcache.daemon (loads and
serves weights), weightcache.operator (Kubernetes control plane).
"""

__version__ = "0.1.0"
