"""The dependency rules of the house, checked on every import statement of the code.

``trajstore`` (command line, supervision, demo) is the top: it imports ``api``, ``workers`` and
``store``, and nothing imports it. ``api`` and ``workers`` import ``store``; ``store`` imports
neither. ``api`` never runs the agent loop in a request (it starts a task), never imports
the replay jobs, and takes from ``workers`` only the modules of :data:`API_USES`. Inside
``workers``, ``workers.engines`` (talking to a model) is below rollout, replay and the
trainer, and the trainer never imports rollout. Only ``store`` talks to the database driver.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import depgraph  # noqa: E402

# (importing part, forbidden prefixes, why)
RULES: list[tuple[str, tuple[str, ...], str]] = [
    ("store", ("workers", "api", "trajstore"),
     "store is the bottom of the graph: the event log and all SQL"),
    ("migrations", ("workers", "api", "trajstore"), "migrations stand alone"),
    ("workers", ("api", "trajstore"), "workers are driven through the store and Celery"),
    ("api", ("trajstore",), "nothing imports the command line"),
    ("api", ("workers.replay.jobs", "workers.celery_tasks"),
     "the API reads projections; replay jobs run in workers"),
    ("api", ("workers.rollout.loop", "workers.rollout.remote", "workers.rollout.group",
             "workers.rollout.agent_tasks"),
     "a request never runs an agent loop: it starts a Celery task"),
    ("workers.trainer", ("workers.rollout",),
     "the trainer talks to engines (workers.engines), never to the agent loop's room"),
    ("workers.engines", ("workers.rollout", "workers.replay", "workers.trainer",
                         "workers.celery_tasks", "workers.app"),
     "engines is the room below rollout, replay and the trainer"),
]
DRIVER = ("psycopg", "psycopg_pool")

# Imports that break a rule today, each with the reason it is still there. Empty is the goal.
# (importing module, imported module or package)
KNOWN: set[tuple[str, str]] = set()


def _matches(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _known(imp: depgraph.Import) -> bool:
    return any(imp.importer == a and _matches(imp.imported, (b,)) for a, b in KNOWN)


@pytest.fixture(scope="module")
def found() -> list[depgraph.Import]:
    return depgraph.imports()


def _where(imp: depgraph.Import) -> str:
    return f"{imp.path.relative_to(depgraph.ROOT)}:{imp.line} imports {imp.imported}"


@pytest.mark.parametrize(("importer", "forbidden", "why"), RULES,
                         ids=[f"{r[0]}-not-{r[1][0]}" for r in RULES])
def test_layer_rule(found: list[depgraph.Import], importer: str, forbidden: tuple[str, ...],
                    why: str) -> None:
    broken = sorted({_where(i) for i in found
                     if _matches(i.importer, (importer,)) and _matches(i.imported, forbidden)
                     and not _known(i)})
    assert not broken, f"{why}:\n" + "\n".join(broken)


# What the pure core of replay may not touch: the database, processes, the network.
IMPURE = ("psycopg", "psycopg_pool", "celery", "redis", "multiprocessing", "subprocess",
          "concurrent", "socket", "httpx", "workers.replay.jobs", "workers.celery_tasks",
          "workers.app")


# The engine modules the pure core of replay may import: rendering only, nothing that loads
# torch, a model or a network client.
PURE_ENGINES = ("workers.engines.render", "workers.engines.chat_template")


def test_replay_core_is_pure(found: list[depgraph.Import]) -> None:
    """``workers.replay`` outside ``workers.replay.jobs`` is plain functions over plain data:
    of the store it reads only the event schemas and the shared argument checks, of the rest
    of ``workers`` only the prompt renderer (:data:`PURE_ENGINES`)."""
    core = [i for i in found if _matches(i.importer, ("workers.replay",))
            and not _matches(i.importer, ("workers.replay.jobs",))]
    broken = sorted({_where(i) for i in core
                     if _matches(i.imported, IMPURE)
                     or (_matches(i.imported, ("store",))
                         and not _matches(i.imported, ("store.events", "store.arguments")))
                     or (_matches(i.imported, ("workers",))
                         and not _matches(i.imported, ("workers.replay", *PURE_ENGINES)))})
    assert not broken, "the replay core does no I/O:\n" + "\n".join(broken)


# What the API may import from workers (a module and what it holds), each with the reason.
API_USES: dict[str, str] = {
    "workers.engines.backend": "the gateway's requests and results are the engines' types",
    "workers.engines.prompt": "the gateway decodes a response as the local backends do",
    "workers.engines.render": "the capture gateway renders prompt ids with the one renderer",
    "workers.engines.content_tokens": "the gateway refuses content that spells a control token "
                                      "with the rule prompt rendering applies",
    "workers.engines.toolcall": "the OpenAI format parses tool calls as rollout does",
    "workers.engines.tokenizers": "the one rule for a run's tokenizer name (checked when a run "
                                  "is created; loaded for timelines, exports and the gateway)",
    "workers.engines.tinymodel": "the in-process engine serves the tiny model when no model "
                                 "is named (imported when that engine starts)",
    "workers.engines.backend_transformers": "the in-process engine of the gateway (imported "
                                            "when it starts, never by import api.app)",
    "workers.replay": "timelines and the UI run the pure replay core on stored events",
    "workers.rollout.remote_request": "a remote rollout's request is checked in the route",
    "workers.rollout.user_tools": "a run's and the server's tools are checked when a run is "
                                  "created and listed by GET /tools (imported, never run)",
    "workers.rollout.fair": "the rollout and branch routes queue within the project's "
                            "rollout budget and answer 429 over it",
    "workers.rollout.remote_dispatch": "the route queues a remote rollout and waits for its "
                                       "answer; a rollout worker plays it",
    "workers.rollout.branch_point": "the branch route finds the turn in the stored episode and "
                                    "queues the branch; a rollout worker plays it",
    "workers.queues": "queue depths for /metrics",
    "workers.datasets": "the dataset routes derive (the replay core under rules), read and "
                        "compare dataset versions",
}


def test_api_imports_only_the_allowed_workers_modules(found: list[depgraph.Import]) -> None:
    broken = sorted({_where(i) for i in found
                     if _matches(i.importer, ("api",)) and _matches(i.imported, ("workers",))
                     and not _matches(i.imported, tuple(API_USES))})
    assert not broken, ("the API imports from workers only API_USES (add a module there with "
                        "its reason):\n" + "\n".join(broken))


# What ``import api.app`` must not load: the agent loop's room, the trainer, the replay jobs,
# and the model runtimes.
NOT_LOADED_BY_API = ("workers.rollout.loop", "workers.rollout.group", "workers.rollout.sandbox",
                     "workers.rollout.rewards", "workers.rollout.agent_tasks",
                     "workers.rollout.remote", "workers.trainer", "workers.replay.jobs",
                     "torch", "transformers", "vllm")


def test_importing_the_api_loads_no_agent_loop_and_no_torch(tmp_path: Path) -> None:
    """Import rules on paper are not enough (a package's ``__init__`` can re-export a heavy
    module): a fresh interpreter imports ``api.app`` and tells what it loaded."""
    script = "import json, sys\nimport api.app\nprint(json.dumps(sorted(sys.modules)))\n"
    env = {**os.environ, "TRAJSTORE_DATA_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    loaded = set(json.loads(done.stdout.splitlines()[-1]))
    assert {"api.app", "workers.engines.backend", "workers.rollout.remote_request"} <= loaded
    heavy = sorted(m for m in loaded if _matches(m, NOT_LOADED_BY_API))
    assert not heavy, f"import api.app loaded {heavy}"


def test_nothing_imports_trajstore(found: list[depgraph.Import]) -> None:
    outside = depgraph.imports(packages=("bench",))
    broken = sorted({_where(i) for i in [*found, *outside]
                     if not _matches(i.importer, ("trajstore",))
                     and _matches(i.imported, ("trajstore",))})
    assert not broken, "the command line is the top of the graph:\n" + "\n".join(broken)


def test_only_store_talks_to_the_driver(found: list[depgraph.Import]) -> None:
    broken = sorted({_where(i) for i in found
                     if not _matches(i.importer, ("store",)) and _matches(i.imported, DRIVER)
                     and not _known(i)})
    assert not broken, "SQL and driver errors live in store/:\n" + "\n".join(broken)


def test_known_exceptions_still_exist(found: list[depgraph.Import]) -> None:
    """An exception that no longer occurs is taken off the list, so it cannot come back."""
    gone = sorted(k for k in KNOWN
                  if not any(i.importer == k[0] and _matches(i.imported, (k[1],))
                             for i in found))
    assert not gone, f"remove from KNOWN: {gone}"


def test_the_checker_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    """The rules are only as good as the parser: an import inside a function, a relative
    import and an importlib.import_module string all count."""
    pkg = tmp_path / "store"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .. import x\n")
    (pkg / "sub" / "m.py").write_text(
        "import importlib\n"
        "def f():\n    from workers.replay import y\n"
        "def g():\n    return importlib.import_module('api.cli')\n"
        "from .n import z\n")
    got = {(i.importer, i.imported)
           for i in depgraph.imports(root=tmp_path, packages=("store",))}
    assert ("store.sub.m", "workers.replay") in got
    assert ("store.sub.m", "api.cli") in got
    assert ("store.sub.m", "store.sub.n") in got
    assert ("store.sub", "store") in got


def test_the_committed_picture_is_the_codes(found: list[depgraph.Import]) -> None:
    """docs/img/dependencies.mmd is what ``python tools/depgraph.py`` draws from the code."""
    assert depgraph.PICTURE.read_text(encoding="utf-8") == depgraph.mermaid(
        depgraph.part_edges(found)), "stale picture: run python tools/depgraph.py"


def _module_cycles(found: list[depgraph.Import]) -> list[list[str]]:
    """The import circles between modules (files), lazy and TYPE_CHECKING imports included;
    a package's ``__init__`` is left out (it hands names on; importing a submodule runs it
    without depending on it)."""
    modules = {imp.importer for imp in found}
    packages = {m for imp in found if imp.path.name == "__init__.py" for m in (imp.importer,)}
    graph: dict[str, set[str]] = {m: set() for m in modules - packages}
    for imp in found:
        if imp.importer in graph and imp.imported in graph and imp.imported != imp.importer:
            graph[imp.importer].add(imp.imported)
    # Tarjan's strongly connected components; a component of two or more is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_no_module_imports_itself_through_others(found: list[depgraph.Import]) -> None:
    """No circle of imports between the project's modules: each room stands above what it
    imports (a circle is two rooms that cannot be understood, or tested, one without the
    other)."""
    assert _module_cycles(found) == []


def test_the_circle_check_finds_a_circle(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("from pkg.a import A\n")
    (tmp_path / "pkg" / "a.py").write_text("A = 1\ndef f():\n    from pkg import b\n")
    (tmp_path / "pkg" / "b.py").write_text("from typing import TYPE_CHECKING\n"
                                           "if TYPE_CHECKING:\n    from pkg.a import A\n")
    (tmp_path / "pkg" / "c.py").write_text("from pkg.a import A\n")
    assert _module_cycles(depgraph.imports(tmp_path, ["pkg"])) == [["pkg.a", "pkg.b"]]
