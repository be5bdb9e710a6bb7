"""The package's structure, read from its source (ast; nothing is imported): no import
circle among the modules of ``sparkccl/``, and no module reads another module's private
attribute.

The rules, precisely:

* **Imports.** An edge A -> B for every ``import``/``from ... import`` of B in module A,
  at any depth (a function-level import is still a dependency); ``from P import n`` is an
  edge to ``P.n`` when that is a module of the package, else to ``P``. The package's own
  ``__init__`` files imported implicitly as parents are not edges, and the native
  extension (``sparkccl._native``) is a leaf. The graph must have no cycle.
* **Private reads.** In module M, ``x._name`` (one leading underscore, not a dunder) is
  allowed when ``x`` is ``self`` or ``cls``, when ``_name`` is defined in M itself
  (assigned as an attribute, a function, class or module name: "same-module access", e.g.
  one class of M reading another's field), or when ``x``'s root is a module imported from
  outside the package (``torch._C``: a third party's API is its own business). The same
  for ``getattr``/``hasattr`` with a constant private name, and for
  ``from sparkccl.X import _name``. Anything else reads another module's private state.
* **Layers** (docs/ARCHITECTURE.md): 1 ``plan/``, 2 ``transport/`` and ``fabric/``, 3
  ``dataplane/``, 4 the communicator (the other top-level modules), 5 the command line and
  ``integrations/``. No module imports a module of a higher layer; the shared modules
  (``layout``, ``config``, ``errors``) may be imported by any layer and import only layer 1;
  the transports may use ``buffers``, ``shm`` and ``bootstrap`` of layer 4 (LAYER_EXCEPTIONS).
"""
from __future__ import annotations

import ast
from pathlib import Path

PKG_DIR = Path(__file__).resolve().parent.parent / "sparkccl"
PKG = "sparkccl"
NATIVE = {"sparkccl._native"}

# Private APIs of third-party objects the package cannot reach otherwise (not sparkccl's).
THIRD_PARTY = {
    # torch.distributed has no public way to register a backend on a group or to read a
    # split's source group (sparkccl/integrations/torch_backend.py).
    ("sparkccl.integrations.torch_backend", "group._register_backend"),
    ("sparkccl.integrations.torch_backend", "group._set_default_backend"),
    ("sparkccl.integrations.torch_backend", "getattr(c10d, '_get_split_source', None)"),
    ("sparkccl.integrations.torch_backend", "getattr(c10d, '_process_group_color', None)"),
}


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG_DIR.rglob("*.py"):
        parts = list(p.relative_to(PKG_DIR.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _absolute(module: str, is_pkg: bool, level: int, name: str | None) -> str:
    if level == 0:
        return name or ""
    base = module.split(".")
    if not is_pkg:
        base.pop()
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


class _Module:
    def __init__(self, name: str, path: Path):
        self.name, self.tree = name, ast.parse(path.read_text(), str(path))
        is_pkg = path.name == "__init__.py"
        self.imports: set[str] = set()
        self.outside: set[str] = set()  # names bound to modules from outside the package
        self.private_imports: list[str] = []
        for n in ast.walk(self.tree):
            if isinstance(n, ast.Import):
                for a in n.names:
                    if a.name == PKG or a.name.startswith(PKG + "."):
                        self.imports.add(a.name)
                    else:
                        self.outside.add((a.asname or a.name).split(".")[0])
            elif isinstance(n, ast.ImportFrom):
                target = _absolute(name, is_pkg, n.level, n.module)
                inside = target == PKG or target.startswith(PKG + ".")
                for a in n.names:
                    if not inside:
                        self.outside.add(a.asname or a.name)
                        continue
                    sub = f"{target}.{a.name}"
                    if sub in MODULES or sub in NATIVE:
                        self.imports.add(sub)
                    else:
                        self.imports.add(target)
                        if _is_private(a.name):
                            self.private_imports.append(f"from {target} import {a.name}")
        self.imports = {m for m in self.imports if m in MODULES and m != name}
        self.defined: set[str] = set()
        for n in ast.walk(self.tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defined.add(n.name)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                self.defined.add(n.attr)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                self.defined.add(n.id)

    def _root(self, node) -> ast.AST:
        while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
            node = node.func if isinstance(node, ast.Call) else node.value
        return node

    def private_reads(self) -> list[str]:
        found = list(self.private_imports)
        for n in ast.walk(self.tree):
            if isinstance(n, ast.Attribute) and _is_private(n.attr):
                obj, attr = n.value, n.attr
            elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                  and n.func.id in ("getattr", "hasattr", "setattr") and len(n.args) >= 2
                  and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str)
                  and _is_private(n.args[1].value)):
                obj, attr = n.args[0], n.args[1].value
            else:
                continue
            if isinstance(obj, ast.Name) and obj.id in ("self", "cls"):
                continue
            if attr in self.defined:
                continue
            root = self._root(obj)
            if isinstance(root, ast.Name) and root.id in self.outside:
                continue
            text = ast.unparse(n)
            if (self.name, text) not in THIRD_PARTY:
                found.append(f"{self.name}:{n.lineno}: {text}")
        return found


PARSED = {name: _Module(name, path) for name, path in MODULES.items()}


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_rules_see_what_they_should():
    """The checker itself: a circle and a private read are found, allowed forms are not."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    src = ("import torch\nclass K:\n    def f(self, other, comm):\n        self._a = 1\n"
           "        other._a\n        torch._C._x()\n        comm._dp\n"
           "        getattr(comm, '_verbs', None)\n")
    m = _Module.__new__(_Module)
    m.name, m.tree, m.outside, m.private_imports = "sparkccl.x", ast.parse(src), {"torch"}, []
    m.defined = {"K", "f", "_a"}
    assert [r.split(": ", 1)[1] for r in m.private_reads()] == [
        "comm._dp", "getattr(comm, '_verbs', None)"]
    assert "sparkccl.comm" in PARSED and "sparkccl.dataplane.cuda" in PARSED
    assert "sparkccl.wiring" in PARSED["sparkccl.comm"].imports


def test_no_import_circle():
    edges = {name: m.imports for name, m in PARSED.items()}
    assert _cycles(edges) == []


def test_no_module_reads_another_modules_private_attributes():
    found = [r for m in PARSED.values() for r in m.private_reads()]
    assert found == [], "\n".join(found)


SHARED = {"sparkccl.layout", "sparkccl.config", "sparkccl.errors"}
COMMAND_LINE = {"cli", "demo", "bench", "bench_timing", "ep_bench", "doctor", "selftest",
                "localrun", "reference", "ep_reference", "exact_checks", "progress"}
# Layer-4 modules the transports use: segments and the rendezvous, no communicator logic.
LAYER_EXCEPTIONS = {"sparkccl.buffers", "sparkccl.shm", "sparkccl.bootstrap"}


def _layer(module: str) -> int:
    if module in SHARED:
        return 0
    parts = module.split(".")
    sub = parts[1] if len(parts) > 1 else ""
    if sub == "plan":
        return 1
    if sub in ("transport", "fabric"):
        return 2
    if sub == "dataplane":
        return 3
    if sub == "integrations" or (len(parts) == 2 and sub in COMMAND_LINE):
        return 5
    return 4


def test_no_layer_calls_up():
    up = []
    for name, m in PARSED.items():
        if name == PKG:  # the package's __init__: exports Communicator (lazily)
            continue
        mine = _layer(name)
        for target in m.imports:
            theirs = _layer(target)
            if mine == 0 and theirs > 1:
                up.append(f"shared {name} -> {target}")
            elif mine and theirs > mine and not (mine == 2 and target in LAYER_EXCEPTIONS):
                up.append(f"{name} (layer {mine}) -> {target} (layer {theirs})")
    assert up == [], "\n".join(up)


def test_third_party_allowances_are_still_needed():
    """An allowance whose read is gone is dropped from THIRD_PARTY (no stale exceptions)."""
    seen = set()
    for m in PARSED.values():
        for n in ast.walk(m.tree):
            if isinstance(n, (ast.Attribute, ast.Call)):
                seen.add((m.name, ast.unparse(n)))
    assert THIRD_PARTY <= seen, THIRD_PARTY - seen
