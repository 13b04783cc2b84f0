"""The one prompt renderer: chat messages to prompt token ids (:func:`prompt_ids`, what
rollout and the capture gateway send to the engine) and to text (:class:`ChatRenderer`, what
replay segments), both from the tokenizer's chat template or the run's own.

``ChatRenderer`` renders chat templates as ``apply_chat_template(..., tokenize=False)`` does,
faster.

transformers renders a chat template in Jinja's ``ImmutableSandboxedEnvironment``, which asks
on every attribute access (``message.role``, ``loop.last``, ``content.startswith``) whether the
attribute is safe; those checks take most of a render's time. The immutable sandbox's answer
depends only on the object's type and the attribute's name (``is_safe_attribute`` tests
``isinstance`` of the object against fixed types and looks at the name, never at the value),
so ``_CachingSandbox`` asks once per (type, name) and remembers the answer for the types that
templates meet (Python's builtins and Jinja's own loop and namespace objects); any other
object goes through the sandbox's checks as before. Nothing else changes: the environment is
a copy of the one transformers compiles the template in (same options, filters, globals,
extensions), the template is rendered with the same variables (the tokenizer's special
tokens, ``tools``, ``documents``, ``add_generation_prompt``), and what the sandbox refuses it
still refuses.

The template is also compiled with ``_InlineLookups``, Jinja's code generator with the most
frequent sandbox lookups written into the template's code: a constant attribute or key of an
exact ``dict`` (``message.role``, ``message['content']``, or the undefined of a missing one),
a value property of ``loop`` (``loop.last``), a plain value of a ``namespace``
(``ns.last_query_index``) and a call of a ``str`` method on a ``str``
(``content.startswith('<tool_response>')``). Those are the sandbox's own answers for those
types (see ``_CachingSandbox.getattr``); every other lookup still calls the sandbox. A loop
whose body reads only position values of ``loop`` (``loop.last``, ``loop.index0``) walks a
list by index instead of through a ``LoopContext``, and looks the context names its body
reads up once (``_InlineLookups.visit_For``).

transformers' ``tojson`` filter (the tool schemas, every tool call's arguments, on every
render) is memoized by ``_memoized_tojson``: JSON text is a function of the value's types,
order and contents, which its ``marshal`` bytes give exactly.

Every render runs under a time budget (``RENDER_BUDGET_S``, default 2 s of the rendering
thread's CPU: waiting for the interpreter lock is not charged): a template is code a
run's creator chose (a run's own ``chat_template``), and one with nested loops could keep a
shared worker busy for minutes or for good. Past the budget the render is interrupted where
it is (``RenderBudgetExceeded`` is raised into the rendering thread, between two Python
instructions of the template's compiled code) and the error names the limit and its
setting; replay records the episode ``invalid`` with it, the timelines route answers 422.

Struck owners render at idle priority. A render past its budget strikes its owner in the
process (``ChatRenderer(owner=...)``: replay passes the run's project; without an owner the
template's source stands for it). For ``RENDER_STRIKE_S`` (default 600 s; 0: off) after the
owner's last strike, in a process that called :func:`isolate_struck_renders` (a replay
worker's pool process, never the API's), the owner's renders run on the process's render
thread, whose CPU priority was lowered once to nice 19, while the caller waits for the
result: the same code under the same budget of the rendering thread's CPU, so the same text
or the same exception (a template error, ``RenderBudgetExceeded``), and a niced render is
charged only for the CPU it got. A project that floods episodes of a template that loops
for ever then spends its budgets on the CPU other projects' replays leave, instead of
taking a core from them for each episode; its ordinary episodes replay as before, at that
priority. Where the thread's priority cannot be lowered (not Linux, not permitted) every
render runs in its caller's thread, as without isolation.

A template's first ``CHECKED`` renders in a process are compared with
``apply_chat_template``'s; a template whose render differs once (a transformers version that
sets up its environment or its inputs differently) is rendered by ``apply_chat_template`` from
then on, as is every template when transformers' compiled environment cannot be had.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import marshal
import os
import threading
import time
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jinja2 import compiler, idtracking, nodes, runtime, utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from workers.engines.content_tokens import check_content
from workers.engines.niced import NicedThread

__all__ = ["ChatRenderer", "RenderBudgetExceeded", "budgets_spent", "is_struck",
           "isolate_struck_renders", "isolated_renders", "isolation_thread", "prompt_ids",
           "render_budget"]

log = logging.getLogger(__name__)

#: Exact types whose instances have no attributes of their own: an attribute the type lacks
#: is looked up as an item straight away (what the sandbox does after its getattr fails);
#: ``dict`` is one too, handled first.
_PLAIN = (list, str)
#: Whether ``dict`` has an attribute of each name asked (a fact of the type, so shared).
_DICT_HAS: dict[str, bool] = {}
#: Types whose safety answers are cached (their ``isinstance`` tests cannot change).
_CACHED = frozenset({dict, list, str, tuple, int, float, bool, type(None),
                     runtime.LoopContext, utils.Namespace, runtime.Macro})
_METHODS = (types.MethodType, types.BuiltinMethodType)
#: ``loop`` attributes that are plain values (properties), which the sandbox allows: read
#: straight away.
_LOOP_VALUES = frozenset({"index", "index0", "revindex", "revindex0", "first", "last",
                          "length", "depth", "depth0", "previtem", "nextitem"})
#: ``loop`` values that follow from the position ``i`` in a list of ``n`` items, as
#: ``LoopContext`` computes them for a loop that is not recursive.
_POSITIONS = {"index0": "{i}", "index": "{i} + 1", "first": "{i} == 0", "last": "{i} == {n} - 1",
              "length": "{n}", "revindex": "{n} - {i}", "revindex0": "{n} - {i} - 1",
              "depth": "1", "depth0": "0"}
#: Nodes whose code can see the loop variable other than through its attributes.
_OPAQUE = (nodes.Macro, nodes.CallBlock, nodes.Block, nodes.Include, nodes.Import,
           nodes.FromImport, nodes.Extends)
_BUILTIN_CALLABLES = (types.BuiltinMethodType, types.BuiltinFunctionType)
#: Methods of ``str`` a template may call without the sandbox's dispatch: every public one
#: but the two it wraps (``format``, ``format_map``). None raises StopIteration, which is all
#: ``Context.call`` would catch.
_STR_METHODS = frozenset(name for name in dir(str) if not name.startswith("_")
                         and callable(getattr(str, name))
                         and name not in ("format", "format_map"))


class _CachingSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with its per-access safety answers cached per (type, name)."""

    _safe: dict[tuple[type, str], bool]
    _has: dict[tuple[type, str], bool]

    def getattr(self, obj: Any, attribute: str) -> Any:
        kind = type(obj)
        if kind is dict:  # a message, a tool call: by far the most frequent
            has = _DICT_HAS.get(attribute)
            if has is None:
                has = _DICT_HAS[attribute] = hasattr(dict, attribute)
            if not has:
                try:
                    return obj[attribute]
                except LookupError:
                    return self.undefined(obj=obj, name=attribute)
        elif kind is runtime.LoopContext and attribute in _LOOP_VALUES:
            return getattr(obj, attribute)
        elif kind not in _CACHED:
            return super().getattr(obj, attribute)
        elif kind in _PLAIN:
            key = (kind, attribute)
            has = self._has.get(key)
            if has is None:
                has = self._has[key] = hasattr(kind, attribute)
            if not has:
                try:
                    return obj[attribute]
                except (TypeError, LookupError):
                    return self.undefined(obj=obj, name=attribute)
        try:
            value = getattr(obj, attribute)
        except AttributeError:
            try:
                return obj[attribute]
            except (TypeError, LookupError):
                return self.undefined(obj=obj, name=attribute)
        if isinstance(value, _METHODS) and value.__name__ in ("format", "format_map"):
            fmt = self.wrap_str_format(value)
            if fmt is not None:
                return fmt
        key = (kind, attribute)
        safe = self._safe.get(key)
        if safe is None:
            safe = self._safe[key] = self.is_safe_attribute(obj, attribute, value)
        return value if safe else self.unsafe_undefined(obj, attribute)

    def call(__self, __context: runtime.Context, __obj: Any, *args: Any,  # noqa: N805
             **kwargs: Any) -> Any:
        # Builtin functions and methods cannot carry the attributes that mark a callable
        # unsafe, so the sandbox would let them through: skip asking.
        if type(__obj) in _BUILTIN_CALLABLES:
            # What Context.call does with a callable that takes no context: drop the
            # compiler's bookkeeping arguments and call it.
            kwargs.pop("_loop_vars", None)
            kwargs.pop("_block_vars", None)
            try:
                return __obj(*args, **kwargs)
            except StopIteration:
                return __self.undefined("value was undefined because a callable raised a"
                                        " StopIteration exception")
        if __obj is utils.Namespace:  # ``namespace(...)``: what the sandbox's call does
            kwargs.pop("_loop_vars", None)
            kwargs.pop("_block_vars", None)
            return utils.Namespace(*args, **kwargs)
        return super().call(__context, __obj, *args, **kwargs)


class _InlineLookups(compiler.CodeGenerator):
    """Jinja's code generator, writing ``x.name`` (and ``x['name']``, a constant string key)
    for an exact ``dict`` ``x`` as its item, with ``x`` evaluated once. That is what the
    sandbox answers for an exact ``dict``: no instance attributes, so the item, which is
    always safe; a missing key is undefined when ``dict`` has no attribute ``name`` either,
    and left to the sandbox when it has. A ``loop`` value property (``_LOOP_VALUES``) is read
    straight from a ``LoopContext`` the same way, a public attribute of a ``namespace`` that
    holds a plain value (``ns.last_query_index``) from the namespace, and ``x.method(consts)``
    of a ``str`` method is called straight away on a ``str``. Anything else (another type, a
    missing attribute, another value) goes to the sandbox as before. Saves a method call and
    its dispatch on most lookups a chat template makes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._temps = 0
        #: (loop variable, length variable) of the positional loops whose bodies are being
        #: compiled.
        self._positional: list[tuple[str, str]] = []

    def _temp(self) -> str:
        """A new name for a value the generated code evaluates once."""
        self._temps += 1
        return f"_lookup_{self._temps}"

    def _inline(self, node: nodes.Expr, frame: compiler.Frame, name: str, fallback: str,
                loop_value: bool) -> None:
        temp = self._temp()
        key = repr(name)
        if hasattr(dict, name):  # a missing key is looked up as the dict's attribute
            self.write(f"({temp}[{key}] if type({temp} := ")
            self.visit(node, frame)
            self.write(f") is dict and {key} in {temp} else ")
        else:  # nor is there an attribute: a missing key is undefined, as the sandbox says
            self.write(f"(({temp}[{key}] if {key} in {temp} else "
                       f"environment.undefined(obj={temp}, name={key})) if type({temp} := ")
            self.visit(node, frame)
            self.write(") is dict else ")
        if loop_value:
            self.write(f"{temp}.{name} if type({temp}) is LoopContext else ")
        if fallback == "getattr" and not name.startswith("_"):
            # A public attribute of a namespace holding a plain value: the sandbox returns
            # the value (``Namespace`` overrides attribute access, so read its dict).
            value = self._temp()
            self.write(f"{value} if type({temp}) is Namespace and type({value} := "
                       f"object.__getattribute__({temp}, '_Namespace__attrs').get({key}, "
                       f"{temp})) in (str, int, bool, float, list, dict, tuple) else ")
        self.write(f"environment.{fallback}({temp}, {key}))")

    @compiler.optimizeconst
    def visit_Getattr(self, node: nodes.Getattr, frame: compiler.Frame) -> None:
        if self.environment.is_async or hasattr(dict, node.attr):
            super().visit_Getattr(node, frame)
            return
        if (self._positional and isinstance(node.node, nodes.Name)
                and node.node.name == "loop" and node.attr in _POSITIONS
                and frame.symbols.find_ref("loop") == self._positional[-1][0]):
            # A positional loop's variable: the index over a list (whose length the loop
            # keeps), a LoopContext over anything else.
            temp = self._temp()
            value = _POSITIONS[node.attr].format(i=temp, n=self._positional[-1][1])
            self.write(f"(({value}) if type({temp} := ")
            self.visit(node.node, frame)
            self.write(") is int else ")
            self._inline(node.node, frame, node.attr, "getattr", True)
            self.write(")")
            return
        self._inline(node.node, frame, node.attr, "getattr", node.attr in _LOOP_VALUES)

    def visit_For(self, node: nodes.For, frame: compiler.Frame) -> None:
        """A loop whose body uses ``loop`` only for values of its position (``loop.last``,
        ``loop.index0``: ``_POSITIONS``) iterates a list as ``(item, index0)`` pairs, with
        the list's length kept beside, instead of through a ``LoopContext`` (the same
        values: a list cannot change while the immutable sandbox loops over it). It looks the
        names its body reads from the context up once instead of on every iteration (only
        top-level assignments change the context, and a loop body is not top level). Other
        iterables, and every other loop, are compiled by Jinja as before."""
        if self.environment.is_async or not _positional(node):
            super().visit_For(node, frame)
            return
        loop_frame = frame.inner()
        loop_frame.loop_frame = True
        else_frame = frame.inner()
        loop_ref = loop_frame.symbols.declare_parameter("loop")
        loop_frame.symbols.analyze_node(node, for_branch="body")
        if node.else_:
            else_frame.symbols.analyze_node(node, for_branch="else")
        hoisted: dict[str, str] = {}
        for target, (action, param) in loop_frame.symbols.loads.items():
            if action == idtracking.VAR_LOAD_RESOLVE:
                hoisted[target] = self._temp()
                self.writeline(f"{hoisted[target]} = {self.get_resolve_func()}({param!r})")
        self.writeline(f"{loop_ref} = missing")
        iteration = None
        if node.else_:
            iteration = self.temporary_identifier()
            self.writeline(f"{iteration} = 1")
        items, length = self._temp(), self._temp()
        self.writeline("for ", node)
        self.visit(node.target, loop_frame)
        self.write(f", {loop_ref} in (zip({items}, range({length} := len({items}))) "
                   f"if type({items} := ")
        self.visit(node.iter, frame)
        self.write(f") is list else LoopContext({items}, undefined)):")
        self.indent()
        undefined = []
        for target, (action, param) in loop_frame.symbols.loads.items():
            if action == idtracking.VAR_LOAD_RESOLVE:
                self.writeline(f"{target} = {hoisted[target]}")
            elif action == idtracking.VAR_LOAD_ALIAS:
                self.writeline(f"{target} = {param}")
            elif action == idtracking.VAR_LOAD_UNDEFINED:
                undefined.append(target)
            elif action != idtracking.VAR_LOAD_PARAMETER:
                raise NotImplementedError("unknown load instruction")
        if undefined:
            self.writeline(f"{' = '.join(undefined)} = missing")
        self.writeline("_loop_vars = {}")
        self._positional.append((loop_ref, length))
        try:
            self.blockvisit(node.body, loop_frame)
        finally:
            self._positional.pop()
        if iteration is not None:
            self.writeline(f"{iteration} = 0")
        self.outdent()
        self.leave_frame(loop_frame)
        if node.else_:
            self.writeline(f"if {iteration}:")
            self.indent()
            self.enter_frame(else_frame)
            self.blockvisit(node.else_, else_frame)
            self.leave_frame(else_frame)
            self.outdent()
        if self._assign_stack:
            self._assign_stack[-1].difference_update(loop_frame.symbols.stores)

    @compiler.optimizeconst
    def visit_Call(self, node: nodes.Call, frame: compiler.Frame,
                   forward_caller: bool = False) -> None:
        callee = node.node
        if (self.environment.is_async or forward_caller or not isinstance(callee, nodes.Getattr)
                or callee.attr not in _STR_METHODS or node.kwargs or node.dyn_args
                or node.dyn_kwargs or not all(isinstance(a, nodes.Const) for a in node.args)):
            super().visit_Call(node, frame, forward_caller=forward_caller)
            return
        # ``x.strip('\n')``: called straight away when ``x`` is a ``str`` (a public method of
        # it, which the sandbox allows and calls as it is), through the sandbox otherwise,
        # with ``x`` evaluated once.
        temp = self._temp()
        self.write(f"({temp}.{callee.attr}(")
        for i, arg in enumerate(node.args):
            if i:
                self.write(", ")
            self.visit(arg, frame)
        self.write(f") if type({temp} := ")
        self.visit(callee.node, frame)
        self.write(") is str else ")
        name = object.__new__(nodes.InternalName)
        nodes.Node.__init__(name, temp, lineno=callee.lineno)
        fallback = nodes.Call(nodes.Getattr(name, callee.attr, callee.ctx, lineno=callee.lineno),
                              node.args, node.kwargs, node.dyn_args, node.dyn_kwargs,
                              lineno=node.lineno)
        super().visit_Call(fallback, frame)
        self.write(")")

    @compiler.optimizeconst
    def visit_Getitem(self, node: nodes.Getitem, frame: compiler.Frame) -> None:
        key = node.arg
        if self.environment.is_async or not isinstance(key, nodes.Const) \
                or type(key.value) is not str:
            super().visit_Getitem(node, frame)
            return
        self._inline(node.node, frame, key.value, "getitem", False)


def _positional(node: nodes.For) -> bool:
    """Whether ``node`` is a loop that is neither recursive nor filtered and whose body uses
    ``loop``, and only as ``loop.<name>`` of ``_POSITIONS`` (never passed on, called, stored or
    seen by a macro, a call block, a block or an included template)."""
    if node.recursive or node.test is not None:
        return False
    used = False

    def plain(n: nodes.Node) -> bool:
        nonlocal used
        if isinstance(n, _OPAQUE):
            return False
        if isinstance(n, nodes.Getattr) and isinstance(n.node, nodes.Name) \
                and n.node.name == "loop":
            used = used or n.attr in _POSITIONS
            return n.attr in _POSITIONS and n.node.ctx == "load"
        if isinstance(n, nodes.Name):
            return n.name != "loop"
        if isinstance(n, nodes.For):  # its body and filter see its own loop variable
            return all(plain(c) for c in (n.target, n.iter, *n.else_))
        return all(plain(c) for c in n.iter_child_nodes())

    return all(plain(c) for c in node.body) and used


#: JSON texts a memoized ``tojson`` keeps before it starts again.
_JSON_CACHE = 4096


def _memoized_tojson(dump: Callable[..., str]) -> Callable[..., str]:
    """``dump`` (transformers' ``tojson``: ``json.dumps`` with the template's options)
    remembering its answers, keyed by the value's ``marshal`` format 0 bytes (exact types,
    key order and contents, so equal bytes give equal JSON) and the options. Values marshal
    refuses (other types) and unhashable options are dumped each time."""
    cache: dict[tuple[bytes, tuple[Any, ...], tuple[Any, ...]], str] = {}

    def tojson(value: Any, *args: Any, **kwargs: Any) -> str:
        try:
            key = (marshal.dumps(value, 0), args, tuple(kwargs.items()))
            out = cache.get(key)
        except (ValueError, TypeError):
            return dump(value, *args, **kwargs)
        if out is None:
            out = dump(value, *args, **kwargs)
            if len(cache) >= _JSON_CACHE:
                cache.clear()
            cache[key] = out
        return out

    return tojson


def _caching_copy(env: ImmutableSandboxedEnvironment) -> _CachingSandbox:
    """A ``_CachingSandbox`` sharing ``env``'s configuration (as ``Environment.overlay``
    builds one), with its extensions bound to the copy."""
    copy = object.__new__(_CachingSandbox)
    copy.__dict__.update(env.__dict__)
    copy.overlayed = True
    copy.linked_to = env
    copy.cache = None
    copy.extensions = {key: ext.bind(copy) for key, ext in env.extensions.items()}
    copy._safe = {}
    copy._has = {}
    copy.code_generator_class = _InlineLookups
    dump = env.filters.get("tojson")
    if callable(dump) and getattr(dump, "__name__", None) == "tojson" \
            and getattr(dump, "__module__", None) == "transformers.utils.chat_template_utils":
        copy.filters = {**env.filters, "tojson": _memoized_tojson(dump)}
    return copy


def _hf_template(source: str) -> Any | None:
    """transformers' compiled template for ``source``, or None when it cannot be had."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return None
    try:
        return _compile_jinja_template(source)
    except Exception:  # a template that does not compile: apply_chat_template says why
        return None


_lock = threading.Lock()
#: Template source -> its compiled fast template (None: render with apply_chat_template).
_compiled: dict[str, _FastTemplate | None] = {}
#: (template source, variables key) -> renders that matched apply_chat_template's so far
#: (-1: one did not).
_verified: dict[tuple[str, str], int] = {}
#: Renders of a template compared with apply_chat_template's before it is trusted.
CHECKED = 8


class _FastTemplate:
    """A compiled template rendered as ``Template.render`` does, with its globals merged
    into a dict once instead of on every render."""

    def __init__(self, template: Any) -> None:
        self.template = template
        self.globals = dict(template.globals)

    def render(self, **variables: Any) -> str:
        template = self.template
        # Template.render builds this dict from the globals' ChainMap and the variables,
        # then renders a context over it; the context does not change the dict. The context
        # is built as Template.new_context builds it, with the names of the globals taken
        # from the merged dict instead of iterating the ChainMap.
        context = template.environment.context_class(
            template.environment, {**self.globals, **variables}, template.name,
            template.blocks, globals=self.globals)
        try:
            return template.environment.concat(template.root_render_func(context))
        except Exception:
            template.environment.handle_exception()
            raise  # not reached: handle_exception raises the exception


def _fast_template(source: str) -> _FastTemplate | None:
    with _lock:
        if source in _compiled:
            return _compiled[source]
    hf = _hf_template(source)
    fast = None
    if hf is not None and type(hf.environment) is ImmutableSandboxedEnvironment:
        try:
            fast = _FastTemplate(_caching_copy(hf.environment).from_string(source))
        except Exception:
            fast = None
    with _lock:
        _compiled[source] = fast
    return fast


class RenderBudgetExceeded(RuntimeError):
    """A chat template rendered past its time budget (the message names the limit and its
    setting)."""


def _budget_message(seconds: float) -> str:
    return (f"the chat template took longer than the render budget of {seconds:g} s of CPU "
            "(setting TRAJSTORE_RENDER_BUDGET_S)")


class _Watchdog:
    """One thread per process that interrupts the budgeted blocks past their budgets (a
    timer thread per render would cost more than a fast render).

    A block's budget is CPU time of its own thread where the platform gives a thread's CPU
    clock (``time.pthread_getcpuclockid``), else wall-clock time: a render that waits for the
    interpreter lock behind other threads (a burst of concurrent requests, a tokenizer
    loading) is not charged for the wait, only a template that computes is stopped.

    The blocks are guarded by a plain ``threading.Lock``, whose ``with`` cannot be split by
    the asynchronous exception the watchdog raises into a block's thread (a ``Condition``'s
    ``__enter__`` is Python code: an exception arriving after it took the lock and before the
    ``with`` began would leave the lock taken for good, and every render of the process
    waiting on it)."""

    TICK_S = 0.05

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._blocks: dict[int, render_budget] = {}
        self._thread: threading.Thread | None = None
        #: Renders interrupted at their budget in this process.
        self.fired = 0

    def add(self, block: render_budget) -> None:
        with self._lock:
            self._blocks[id(block)] = block
            start = self._thread is None
            if start:
                self._thread = threading.Thread(target=self._run, name="render-budget",
                                                daemon=True)
        if start:
            assert self._thread is not None
            self._thread.start()
        self._wake.set()

    def start(self) -> None:
        """Starts the watchdog's thread now, from the calling thread (a thread takes the CPU
        priority of the thread that starts it: the idle render thread must not), or again
        in a process forked after it started (its thread is not in the child)."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._thread = threading.Thread(target=self._run, name="render-budget",
                                            daemon=True)
            self._thread.start()

    def remove(self, block: render_budget) -> bool:
        """Forgets ``block``; whether it was interrupted (a pending interruption is
        withdrawn, so it is never raised after the block)."""
        with self._lock:
            self._blocks.pop(id(block), None)
            if block.fired:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(block.thread), None)
            return block.fired

    def _run(self) -> None:
        while True:
            with self._lock:
                idle = not self._blocks
                if idle:
                    self._wake.clear()
            if idle:
                self._wake.wait()
                continue
            time.sleep(self.TICK_S)
            with self._lock:
                for key, block in list(self._blocks.items()):
                    if block.fired:
                        # Interrupted, and its thread left the block without removing it
                        # (the exception arrived in the block's own exit): forget it.
                        if time.monotonic() > block.fired_at + 1.0:
                            del self._blocks[key]
                        continue
                    try:
                        spent = block.spent()
                    except OSError:  # its thread is gone
                        del self._blocks[key]
                        continue
                    if spent >= block.seconds_:
                        block.fired = True
                        block.fired_at = time.monotonic()
                        self.fired += 1
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(
                            ctypes.c_ulong(block.thread),
                            ctypes.py_object(RenderBudgetExceeded))


_watchdog = _Watchdog()


def budgets_spent() -> int:
    """How many renders this process has interrupted at their budget so far (each cost a
    whole ``RENDER_BUDGET_S`` of CPU)."""
    return _watchdog.fired


def _thread_clock() -> int | None:
    """The CPU clock of the calling thread, or None where the platform has none."""
    getter = getattr(time, "pthread_getcpuclockid", None)
    if getter is None:
        return None
    try:
        return int(getter(threading.get_ident()))
    except (OSError, OverflowError):
        return None


class render_budget:  # noqa: N801 - used as a context manager, like a function
    """Interrupts the block in the calling thread once it has spent ``seconds`` of its
    thread's CPU time (wall-clock time where the platform gives no thread CPU clock; None or
    <= 0: no limit; checked every 50 ms) by raising ``RenderBudgetExceeded`` into it; the
    block is plain Python (a template's compiled code), so it stops at its next
    instruction. A block that ends first is never interrupted afterwards: a pending
    interruption is withdrawn under the watchdog's lock."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.seconds_ = float(seconds or 0)
        self.thread = 0
        self.fired = False
        self.fired_at = 0.0
        self._clock: int | None = None
        self._start = 0.0
        self._on = False

    def spent(self) -> float:
        """Seconds the block has spent so far (its thread's CPU, or wall-clock time)."""
        if self._clock is not None:
            return time.clock_gettime(self._clock) - self._start
        return time.monotonic() - self._start

    def __enter__(self) -> render_budget:
        if self.seconds is not None and self.seconds > 0:
            self.thread = threading.get_ident()
            self._clock = _thread_clock()
            self._start = (time.clock_gettime(self._clock) if self._clock is not None
                           else time.monotonic())
            self._on = True
            _watchdog.add(self)
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if self._on and _watchdog.remove(self):
            raise RenderBudgetExceeded(_budget_message(float(self.seconds or 0))) from None


def _default_budget() -> float:
    from store.settings import get_settings

    return float(get_settings().render_budget_s)


def _default_strike() -> float:
    from store.settings import get_settings

    return float(get_settings().render_strike_s)


#: Owner key -> ``time.monotonic()`` of its last render past the budget in this process.
_strikes: dict[str, float] = {}
_strikes_lock = threading.Lock()


def _strike(key: str, strike_s: float) -> None:
    """Remember that ``key``'s render ran past its budget now (forgetting strikes older than
    ``strike_s``, so the table holds only the owners struck lately)."""
    now = time.monotonic()
    with _strikes_lock:
        first = key not in _strikes
        for old in [k for k, at in _strikes.items() if now - at >= strike_s]:
            del _strikes[old]
        _strikes[key] = now
    if first and _isolation is not None:
        log.warning("%s: a chat template ran past its render budget; its renders run at idle "
                    "priority for %g s (TRAJSTORE_RENDER_STRIKE_S)", key, strike_s)


def _struck(key: str, strike_s: float) -> bool:
    """Whether ``key`` struck within the last ``strike_s`` seconds (an older strike is
    forgotten here)."""
    with _strikes_lock:
        at = _strikes.get(key)
        if at is None:
            return False
        if time.monotonic() - at < strike_s:
            return True
        del _strikes[key]
        return False


def is_struck(owner: str, strike_s: float | None = None) -> bool:
    """Whether renders of ``owner`` (a project id as replay passes it) ran past the budget
    within the last ``strike_s`` seconds (None: ``RENDER_STRIKE_S``) in this process. An
    owner never struck, or struck longer ago, is not."""
    return _struck(f"project {owner}", _default_strike() if strike_s is None else strike_s)


#: The idle render thread of a process that isolates struck renders (None: every render
#: runs in its caller's thread).
_isolation: NicedThread | None = None
_isolation_lock = threading.Lock()
_isolated = 0


def isolate_struck_renders(on: bool = True) -> bool:
    """From now on, in this process, render the templates of struck owners (module
    docstring) on a render thread of the process at nice 19, the lowest CPU priority,
    started here; ``on=False`` renders every template in its caller's thread again. Returns
    whether isolation is on: False where the thread's priority cannot be lowered (not Linux,
    not permitted), and every render then runs in its caller's thread as before.

    Call it in a replay worker's pool process only (``workers.celery_tasks`` does, for
    prefork children of a worker on the ``replay`` queue), never in the API process
    (``trajstore serve``) nor a worker of threads: a niced thread that holds the interpreter
    lock while the kernel leaves it off the CPU (the machine busy with everyone else's
    work, which is when it matters) would stall every other thread of the process behind
    it, the API's request threads with it (priority inversion). In a replay worker's pool
    process the caller waits for the render anyway, and the only other thread is the
    budget's watchdog. The render thread does not survive a fork: a child calls this
    again."""
    global _isolation
    with _isolation_lock:
        if not on:
            _isolation = None
            return False
        if _isolation is not None and _isolation.usable():
            return True
        _watchdog.start()
        thread = NicedThread(19, "render-idle")
        if not thread.niced:
            _isolation = None
            log.warning("struck renders are not isolated: the render thread's priority "
                        "could not be lowered (%s)", thread.error)
            return False
        _isolation = thread
    log.info("renders of templates past their budget run at nice 19 on thread %d for "
             "TRAJSTORE_RENDER_STRIKE_S", thread.native_id)
    return True


def _forget_isolation_after_fork() -> None:
    global _isolation, _isolation_lock
    _isolation = None
    _isolation_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_isolation_after_fork)


def isolated_renders() -> int:
    """How many renders this process has run on its idle render thread so far."""
    return _isolated


def isolation_thread() -> int | None:
    """The kernel's id of this process's idle render thread (``os.getpriority(
    os.PRIO_PROCESS, id)`` is its nice value), or None when isolation is off."""
    found = _isolation
    return found.native_id if found is not None else None


class ChatRenderer:
    """Renders ``tokenizer``'s chat template (or ``chat_template``) the way
    ``tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
    add_generation_prompt=..., chat_template=chat_template)`` does, and gives the same text
    (see the module docstring). Exceptions are those of the template (or of
    ``apply_chat_template``). ``owner``: whose template it is (replay passes the run's
    project), to remember its renders past the budget by (module docstring, struck owners);
    None: the template's source stands for its owner. Raises TypeError when ``owner`` is
    neither a string nor None."""

    def __init__(self, tokenizer: Any, *, chat_template: str | None = None,
                 budget_s: float | None = None, owner: str | None = None) -> None:
        if owner is not None and not isinstance(owner, str):
            raise TypeError(f"owner must be a project id (a string) or None, got "
                            f"{type(owner).__name__}")
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        #: Seconds one render may take (module docstring); None: the setting.
        self.budget_s = _default_budget() if budget_s is None else budget_s
        self.owner = owner
        #: Seconds a render past the budget marks its owner struck (``RENDER_STRIKE_S``).
        self.strike_s = _default_strike()
        self._owner_key: str | None = None if owner is None else f"project {owner}"
        #: The template's source and compiled template, with and without tools (None:
        #: rendered by apply_chat_template).
        self._fast: dict[bool, tuple[str, _FastTemplate | None]] = {}
        self._variables: dict[str, Any] | None = None
        self._variables_key = ""
        self._reads_clock: dict[bool, bool] = {}

    def _source(self, with_tools: bool) -> str | None:
        getter = getattr(self.tokenizer, "get_chat_template", None)
        if getter is None:
            return None
        try:
            source = getter(self.chat_template, [{}] if with_tools else None)
        except Exception:
            return None
        return source if isinstance(source, str) else None

    def _compiled(self, with_tools: bool) -> tuple[str, _FastTemplate | None]:
        """The template's source and its compiled template (None: render with
        apply_chat_template), found once per renderer."""
        found = self._fast.get(with_tools)
        if found is None:
            source = self._source(with_tools)
            found = self._fast[with_tools] = (
                (source, _fast_template(source)) if source is not None else ("", None))
        return found

    def _template_variables(self) -> dict[str, Any]:
        if self._variables is None:
            self._variables = dict(self.tokenizer.special_tokens_map)
            self._variables_key = repr(sorted(self._variables.items()))
        return self._variables

    def reads_clock(self, *, tools: bool) -> bool:
        """Whether the template (its variant with ``tools`` or without) may call
        ``strftime_now``, the clock transformers gives templates (Llama 3.x writes today's
        date into its system block): its renders then depend on the day, and replay renders
        with the clock the prompt was rendered with (``render(..., clock=...)``)."""
        found = self._reads_clock.get(tools)
        if found is None:
            found = self._reads_clock[tools] = "strftime_now" in self._compiled(tools)[0]
        return found

    def _slow(self, messages: Sequence[Mapping[str, Any]],
              tools: Sequence[Mapping[str, Any]] | None, generation_prompt: bool,
              clock: Callable[[str], str] | None = None) -> Any:
        """``apply_chat_template`` on copies of ``messages`` and ``tools``."""
        extra = {"strftime_now": clock} if clock is not None else {}
        return self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], tools=[dict(t) for t in tools] if tools else None,
            tokenize=False, add_generation_prompt=generation_prompt,
            chat_template=self.chat_template, **extra)

    def render(self, messages: Sequence[Mapping[str, Any]], *,
               tools: Sequence[Mapping[str, Any]] | None, generation_prompt: bool,
               clock: Callable[[str], str] | None = None) -> Any:
        """The template's output for ``messages`` and ``tools`` (``apply_chat_template`` is
        given copies; the compiled template, which cannot change them, exact dicts as they
        are), with ``clock`` as the template's ``strftime_now`` when given (else the
        current time's, as transformers gives it). Raises RenderBudgetExceeded past
        ``budget_s``, and marks the owner struck then. The render of a struck owner runs on
        the process's idle render thread where ``isolate_struck_renders`` is on (the same
        code, so the same text or exception; the caller waits for it)."""
        global _isolated
        isolation = _isolation
        strike_s = self.strike_s
        if strike_s <= 0:
            return self._render(messages, tools, generation_prompt, clock)
        try:
            if isolation is not None and isolation.usable() \
                    and _struck(self._key(), strike_s):
                with _strikes_lock:
                    _isolated += 1
                return isolation.run(
                    lambda: self._render(messages, tools, generation_prompt, clock))
            return self._render(messages, tools, generation_prompt, clock)
        except RenderBudgetExceeded:
            _strike(self._key(), strike_s)
            raise

    def _key(self) -> str:
        """What this renderer's strikes are remembered by: its owner, else its template."""
        key = self._owner_key
        if key is None:
            template = self.chat_template
            if not isinstance(template, str):
                template = repr(getattr(self.tokenizer, "chat_template", None))
            digest = hashlib.sha256(template.encode("utf-8", "surrogatepass")).hexdigest()
            key = self._owner_key = f"template {digest[:16]}"
        return key

    def _render(self, messages: Sequence[Mapping[str, Any]],
                tools: Sequence[Mapping[str, Any]] | None, generation_prompt: bool,
                clock: Callable[[str], str] | None) -> Any:
        chat = [m if type(m) is dict else dict(m) for m in messages]
        schemas = [t if type(t) is dict else dict(t) for t in tools] if tools else None
        source, fast = self._compiled(schemas is not None)
        variables = self._template_variables()
        if clock is not None:
            variables = {**variables, "strftime_now": clock}
        key = (source, self._variables_key)
        matched = _verified.get(key, 0)
        if fast is None or not chat or matched < 0:
            with render_budget(self.budget_s):
                return self._slow(messages, tools, generation_prompt, clock)
        with render_budget(self.budget_s):
            out = fast.render(messages=chat, tools=schemas, documents=None,
                              add_generation_prompt=generation_prompt, **variables)
        if matched < CHECKED:
            with render_budget(self.budget_s):
                expected = self._slow(messages, tools, generation_prompt, clock)
            with _lock:
                if _verified.get(key, 0) >= 0:
                    _verified[key] = _verified.get(key, 0) + 1 if expected == out else -1
            return expected
        return out


def prompt_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]], *,
               tools: Sequence[Mapping[str, Any]] | None = None,
               chat_template: str | None = None) -> list[int]:
    """The prompt token ids of ``messages`` (and ``tools``): the chat template
    (``chat_template`` when given, else the tokenizer's) rendered with the generation prompt
    appended and tokenized, as ``apply_chat_template(..., add_generation_prompt=True,
    tokenize=True)`` gives them; rendering the same messages as text with
    :class:`ChatRenderer` and encoding it without special tokens gives the same ids.
    ``messages`` and ``tools`` are copied, never changed. Raises ValueError when neither
    the tokenizer nor the caller has a chat template, ``ControlTokenInContent`` (a
    ValueError) when a string of the messages or tools spells one of the tokenizer's control
    tokens (``workers.engines.content_tokens``: refused, never rendered); the template's own
    errors propagate."""
    if not chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError("tokenizer has no chat_template; pass prompt_ids instead of messages")
    check_content(tokenizer, messages, tools)
    kwargs: dict[str, Any] = {"tools": [dict(t) for t in tools] if tools else None,
                              "add_generation_prompt": True, "tokenize": True,
                              "return_dict": False}
    if chat_template:
        kwargs["chat_template"] = chat_template
    return [int(i) for i in tokenizer.apply_chat_template([dict(m) for m in messages],
                                                          **kwargs)]
