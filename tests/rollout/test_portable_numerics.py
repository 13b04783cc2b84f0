"""The demo's portable numerics: torch's CPU kernels capped at AVX2 where the machine has it,
what the user set kept, and a process started with the variables computing with AVX2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from workers.engines import portable
from workers.engines.portable import PORTABLE_CPU, has_avx2, portable_cpu_environment


def test_sets_what_is_missing_and_keeps_what_the_user_set(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.setattr(portable, "has_avx2", lambda: True)
    env = {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "PATH": "/bin"}
    added = portable_cpu_environment(env)
    assert added == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert env == {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "PATH": "/bin", **added}
    assert portable_cpu_environment(env) == {}  # a second call changes nothing


def test_a_machine_without_avx2_is_left_alone(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse sse2 avx\n")
    monkeypatch.setattr(portable.platform, "machine", lambda: "x86_64")
    assert not has_avx2(str(cpuinfo))
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma\n")
    assert has_avx2(str(cpuinfo))
    assert not has_avx2(str(tmp_path / "missing"))
    monkeypatch.setattr(portable.platform, "machine", lambda: "aarch64")
    assert not has_avx2(str(cpuinfo))
    monkeypatch.setattr(portable, "has_avx2", lambda: False)
    env: dict[str, str] = {}
    assert portable_cpu_environment(env) == {} and env == {}


@pytest.mark.skipif(not has_avx2(), reason="the machine has no AVX2")
def test_a_process_with_the_variables_computes_with_avx2() -> None:
    import os

    env = {k: v for k, v in os.environ.items() if k not in PORTABLE_CPU}
    portable_cpu_environment(env)
    out = subprocess.run([sys.executable, "-c", "import torch; torch.ones(64) @ torch.ones(64); "
                          "print(torch.backends.cpu.get_cpu_capability())"],
                         env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "AVX2"
