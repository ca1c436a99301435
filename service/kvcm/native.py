"""kvcm's optional C core (``kvcm._native``, docs/native.md): loaded once, switchable.

The C extension is built by ``pip install`` when a C compiler is there; without it, or with
``KVCM_NATIVE=0`` in the environment, ``core`` is None and every caller takes its numpy path,
which gives the same results (tests/test_native.py runs both and compares them).

``core`` is read at each call, so a test can switch it (``use(False)``) on a live manager.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

#: The C core's interface version this Python code calls (``kvcm._native.API``): bumped when
#: a function's arguments or results change, so that an extension built from older sources
#: (a checkout pulled without rebuilding) is not called with new arguments.
API = 12

try:
    # By name: an import of the package's extension by ``from . import`` reads, to import
    # checkers, as an import of the package itself (and so of everything it re-exports).
    _loaded: ModuleType | None = importlib.import_module("kvcm._native")
except ImportError:  # not built (no compiler): the numpy paths
    _loaded = None
#: The built core if its interface is this code's, else None (``stale`` says which).
_built = _loaded if getattr(_loaded, "API", None) == API else None
stale = _loaded is not None and _built is None

#: The C core, or None (not built, or switched off). Block keys are hashed in C only where
#: ``core.HAVE_SHA_EXTENSIONS``: portable C SHA-256 is slower than the OpenSSL that hashlib
#: calls.
core: ModuleType | None = None if os.environ.get("KVCM_NATIVE", "1") == "0" else _built


def available() -> bool:
    """Whether the C core was built (whatever ``use`` chose)."""
    return _built is not None


def use(on: bool) -> bool:
    """Switch the C core on (if built) or off; returns whether it is now on."""
    global core
    core = _built if on else None
    return core is not None


def summary() -> str:
    """What runs the step path, for ``kvcm serve``'s first line: "C (SHA extensions)", "C",
    "numpy (KVCM_NATIVE=0)", "numpy (kvcm._native is stale: ...)" or "numpy (kvcm._native
    not built)"."""
    if core is not None:
        return "C (SHA extensions)" if core.HAVE_SHA_EXTENSIONS else "C"
    if stale:
        return "numpy (kvcm._native is stale: rebuild it, e.g. bash scripts/setup)"
    return "numpy (KVCM_NATIVE=0)" if available() else "numpy (kvcm._native not built)"
