"""The ``trajstore`` command line, process supervision (``trajstore up``) and the demo.

This package is the top of the dependency graph: it imports ``api``, ``workers`` and
``store``, and nothing imports it. ``python -m trajstore`` runs the command line.
"""

__all__: list[str] = []
