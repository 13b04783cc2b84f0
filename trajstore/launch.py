"""Which code a trajstore process runs: its own packages, never a folder that happens to share
their names.

trajstore installs the top-level packages ``store``, ``workers``, ``api`` and ``migrations``
beside ``trajstore``. Those are common names: a user's project may hold a ``store/`` or an
``api/`` package of its own. Three rules keep the command line on trajstore's:

- ``python -m trajstore`` drops the working folder Python put first on the path
  (:func:`drop_working_folder`), unless the working folder is where trajstore's code lives (a
  checkout run from its root). The ``trajstore`` console script never had it on its path.
- The processes trajstore starts (Celery workers, ``trajstore up``'s children, torchrun's
  ranks) run with :func:`child_environment`: Python's safe-path mode (``PYTHONSAFEPATH``, so
  ``python -m`` adds no working folder) and, when trajstore runs from a checkout, that
  checkout first on ``PYTHONPATH``, so a child runs the code its parent runs.
- :func:`check_own_packages` refuses to go on when one of those packages still comes from
  somewhere else (a folder on the user's ``PYTHONPATH``), naming the folder, instead of
  failing later on a confusing missing name.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import sysconfig
from collections.abc import Mapping
from pathlib import Path

__all__ = ["CODE_ROOT", "OWN_PACKAGES", "check_own_packages", "child_environment",
           "drop_working_folder"]

#: The folder holding ``trajstore/`` and its sibling packages (site-packages, or a checkout).
CODE_ROOT = Path(__file__).resolve().parents[1]
#: The top-level packages the distribution installs beside ``trajstore``.
OWN_PACKAGES = ("store", "workers", "api", "migrations")


def drop_working_folder() -> None:
    """Remove the working folder that ``python -m`` put first on ``sys.path``, unless it is
    :data:`CODE_ROOT`. Does nothing in safe-path mode, where Python did not put it there."""
    if sys.flags.safe_path or not sys.path:
        return
    first = sys.path[0]
    if first not in ("", os.getcwd()):
        return
    if Path(first or os.curdir).resolve() != CODE_ROOT:
        del sys.path[0]


def check_own_packages() -> None:
    """Exit with a message naming the folder when one of :data:`OWN_PACKAGES` would be
    imported from anywhere but :data:`CODE_ROOT` (or cannot be found at all)."""
    for name in OWN_PACKAGES:
        spec = importlib.util.find_spec(name)
        origin = Path(spec.origin).resolve() if spec and spec.origin else None
        if origin is not None and origin.parent.parent == CODE_ROOT:
            continue
        found = f"is {origin.parent}" if origin else "cannot be found"
        raise SystemExit(
            f"trajstore: the package {name!r} {found}, not trajstore's own in {CODE_ROOT}. "
            f"A folder on the Python path (PYTHONPATH, or the working folder of "
            f"'python <script>') holds a package of that name; run trajstore with that "
            f"folder off the path (the 'trajstore' command or 'python -m trajstore' leave "
            f"the working folder out).")


def child_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (this process's environment when None) for a Python process trajstore starts:
    with ``PYTHONSAFEPATH=1`` and, when :data:`CODE_ROOT` is a checkout rather than an
    installation folder, :data:`CODE_ROOT` first on ``PYTHONPATH``."""
    result = dict(os.environ if env is None else env)
    result["PYTHONSAFEPATH"] = "1"
    installed = {Path(sysconfig.get_path(key)).resolve() for key in ("purelib", "platlib")}
    if CODE_ROOT not in installed:
        rest = [p for p in result.get("PYTHONPATH", "").split(os.pathsep)
                if p and Path(p).resolve() != CODE_ROOT]
        result["PYTHONPATH"] = os.pathsep.join([str(CODE_ROOT), *rest])
    return result
