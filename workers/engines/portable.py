"""The same numbers on every x86-64 machine: torch's CPU kernels capped at AVX2.

torch picks its CPU kernels by the instruction set of the machine it runs on (AVX2 or
AVX-512 for its own vectorised kernels, MKL's and oneDNN's for matrix products), and kernels
of different widths add in different orders: the last bits of a logit differ from one machine
to the next. A sampled token then flips where two tokens are near a tie, and a run of the
main job from one seed goes its own way on each kind of machine (seed 0 of the demo rose to a
last-three strict reward of 0.635 with AVX-512 and 0.552 with AVX2, its tool error rate
falling on one and rising on the other). Capping every process of a run at AVX2, which every
x86-64 server of the last decade has, gives the same kernels, and the same numbers, on all of
them, at a small cost in speed on AVX-512 machines.

:func:`portable_cpu_environment` is what the main job (``trajstore demo``) puts in its own
environment before torch computes anything, and so in its workers' and warm-start ranks'.
A variable the user already set wins. Other machines (ARM, or x86-64 without AVX2) and CUDA
devices are left as they are: their numbers are their own.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping, MutableMapping

__all__ = ["PORTABLE_CPU", "has_avx2", "portable_cpu_environment"]

#: torch's own kernels, MKL's and oneDNN's, each capped at AVX2.
PORTABLE_CPU: Mapping[str, str] = {"ATEN_CPU_CAPABILITY": "avx2",
                                   "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                                   "ONEDNN_MAX_CPU_ISA": "AVX2"}


def has_avx2(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this is an x86-64 machine whose CPU has AVX2 (read from ``cpuinfo``; False
    where it cannot be read)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            return any(line.startswith("flags") and " avx2" in line for line in f)
    except OSError:
        return False


def portable_cpu_environment(environ: MutableMapping[str, str] | None = None
                             ) -> dict[str, str]:
    """Set :data:`PORTABLE_CPU` in ``environ`` (default: this process's) where the machine
    has AVX2 and the variable is not set already; returns what was set (empty elsewhere).
    Takes effect for torch in this process only before its first computation."""
    target = os.environ if environ is None else environ
    if not has_avx2():
        return {}
    added = {k: v for k, v in PORTABLE_CPU.items() if k not in target}
    target.update(added)
    return added
