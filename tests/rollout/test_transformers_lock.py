"""The first uses of transformers' names from several threads at once (a tokenizer, a model
class, a model folder) all succeed: they are taken one after the other
(``workers.engines.transformers_lock``). transformers resolves its names lazily, and two
threads resolving at once could see a module half-built ("Could not import module
'Qwen3ForCausalLM'")."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_FIRST_USES = """
    import sys, threading, traceback
    folder = sys.argv[1]
    from workers.engines.backend_transformers import TransformersBackend
    from workers.engines.tokenizers import load_tokenizer
    from workers.trainer.checkpoint import load_model
    from workers.engines.tinymodel import build_tiny_tokenizer
    start = threading.Barrier(4)
    errors = []

    def run(load):
        start.wait()
        try:
            load()
        except Exception:
            errors.append(traceback.format_exc())

    loads = [lambda: load_tokenizer("qwen3"), lambda: load_model(folder),
             lambda: TransformersBackend(folder), lambda: load_tokenizer(folder)]
    threads = [threading.Thread(target=run, args=(load,)) for load in loads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("\\n".join(errors) or "ok")
"""


def test_first_uses_of_transformers_names_from_four_threads_at_once(tmp_path: Path) -> None:
    folder = tmp_path / "tiny"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    built = subprocess.run(
        [sys.executable, "-c", "import sys; from workers.engines.tinymodel import "
         "build_tiny_model; build_tiny_model(sys.argv[1])", str(folder)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    # A fresh interpreter each time: the names are resolved for good by the first round.
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(_FIRST_USES), str(folder)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip().splitlines()[-1:] == ["ok"], done.stdout[-3000:]
