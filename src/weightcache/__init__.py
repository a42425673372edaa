"""weightcache: a node-local GPU weight cache for LLM inference on Kubernetes.

Subpackages: weightcache.client (what engines import), weightcache.daemon (loads and
serves weights), weightcache.operator (Kubernetes control plane).
"""

import pathlib

__version__ = "0.1.0"

# In a source checkout installed in editable mode, weightcache.operator is the folder
# operator/ beside src/. It has no __init__.py (a regular package named `operator` at
# the repository root would shadow the standard library), and setuptools' editable
# finder cannot map such a folder as a subpackage; so the checkout's root joins this
# package's search path. A wheel install holds weightcache/operator itself and skips this.
_CHECKOUT = pathlib.Path(__file__).resolve().parents[2]
if (_CHECKOUT / "operator" / "handlers.py").is_file() and (_CHECKOUT / "src" / "weightcache").is_dir():
    __path__.append(str(_CHECKOUT))  # noqa: F821  (__path__ is a package's own global)
