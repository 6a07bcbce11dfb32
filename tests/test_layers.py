"""lockstep's imports point down: no import circle, no import from a lower layer to a higher one.

The import graph is read statically (``ast``), lazy imports inside functions included, so an
import that only runs on some path still counts. ``LAYERS`` is the one written copy of the
layer table; docs/contributing.md mirrors it and ``test_docs_mirror_the_layer_table`` keeps
the two equal. ``KNOWN_UPWARD`` and ``KNOWN_CIRCLES`` list what is still wrong today; fixing one
removes its entry (a stale entry fails too, so the lists only shrink).
"""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lockstep"

# Bottom up. A module belongs to the layer of the longest prefix that names it; it may import
# its own layer and the layers below, never a layer above.
LAYERS: list[tuple[str, list[str]]] = [
    ("base", [
        "lockstep._torch_compat", "lockstep._torch_compat_compile", "lockstep.env", "lockstep.tensors",
        "lockstep.lazy", "lockstep.teardown", "lockstep.virtual_world", "lockstep.profilers",
        "lockstep.rejoin", "lockstep.wrappers", "lockstep.shards", "lockstep.loader_position",
    ]),
    ("diagnose", [
        "lockstep.diagnose",
        # shims of the modules now in lockstep.diagnose, at the layer of what they re-export
        "lockstep.progress", "lockstep.blame", "lockstep.hang", "lockstep.abort_guard",
        "lockstep.collective_checks", "lockstep.watchdog", "lockstep.stackdump",
    ]),
    ("collectives", [
        "lockstep.distributed", "lockstep.launcher.spawn", "lockstep.launcher.payload",
        "lockstep.multiproc", "lockstep.small_gather",
    ]),
    ("comm hooks", ["lockstep.comm"]),
    ("parallel", [
        "lockstep.ddp", "lockstep.dp", "lockstep.fsdp", "lockstep.zero", "lockstep.sampler",
        "lockstep.virtual_sampler", "lockstep.checkpoint", "lockstep.pipeline",
        "lockstep.sync_batchnorm", "lockstep.accumulation", "lockstep.resilience",
    ]),
    ("doctor, plan", ["lockstep.doctor", "lockstep.plan", "lockstep.ddp.timing"]),
    ("launcher", ["lockstep.launcher", "lockstep.helper"]),
    ("commands", [
        "lockstep", "lockstep.__main__", "lockstep.cli", "lockstep.doctor.command",
    ]),
]

# (importer, imported) pairs that go up a layer today. Each fix removes its line.
KNOWN_UPWARD: set[tuple[str, str]] = set()

# Import circles today, each as the sorted modules in it. Each fix removes its line.
KNOWN_CIRCLES: set[tuple[str, ...]] = set()


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _targets(module: str, path: pathlib.Path, node: ast.AST, known: dict) -> list[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        if node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            stem = ".".join(base + ([node.module] if node.module else []))
        else:
            stem = node.module or ""
        names = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in known else stem for a in node.names]
    else:
        return []
    out = []
    for name in names:
        if name.split(".")[0] != "lockstep":
            continue
        while name not in known and "." in name:
            name = name.rpartition(".")[0]
        if name != module:
            out.append(name)
    return out


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and (
        (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")
    )


def import_graph(packages: bool = False) -> dict[str, set[str]]:
    """Module -> the lockstep modules it imports, anywhere in its body.

    With ``packages``, importing ``lockstep.a.b`` also counts as importing the package
    ``lockstep.a`` (Python runs its ``__init__`` first): how circles form at run time.
    """
    known = _modules()
    graph: dict[str, set[str]] = {name: set() for name in known}
    for module, path in known.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        # Imports under ``if TYPE_CHECKING:`` never run: they count as a layer's dependency but
        # cannot close a circle at run time.
        type_only = {id(n) for block in ast.walk(tree) if _is_type_checking(block)
                     for stmt in block.body for n in ast.walk(stmt)} if packages else set()
        for node in ast.walk(tree):
            if id(node) not in type_only:
                graph[module].update(_targets(module, path, node, known))
    if packages:
        for module, targets in graph.items():
            for target in list(targets):
                parts = target.split(".")
                for end in range(2, len(parts)):
                    parent = ".".join(parts[:end])
                    if parent != module and not module.startswith(parent + "."):
                        targets.add(parent)
    return graph


def layer_of(module: str) -> int:
    best, level = -1, None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, level = len(prefix), index
    if level is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in tests/test_layers.py")
    return level


def upward_imports(graph: dict[str, set[str]] | None = None) -> set[tuple[str, str]]:
    graph = import_graph() if graph is None else graph
    return {(a, b) for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a)}


def circles(graph: dict[str, set[str]] | None = None) -> set[tuple[str, ...]]:
    """Strongly connected components of more than one module (Tarjan), package inits included."""
    graph = import_graph(packages=True) if graph is None else graph
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[tuple[str, ...]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.add(tuple(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_is_in_a_layer():
    for module in import_graph():
        layer_of(module)


def test_no_new_upward_import():
    new = upward_imports() - KNOWN_UPWARD
    assert not new, (
        "imports from a lower layer to a higher one (see the layer table in "
        f"docs/contributing.md; offer an observer or move the helper down): {sorted(new)}"
    )


def test_no_new_import_circle():
    new = circles() - KNOWN_CIRCLES
    assert not new, f"import circles: {sorted(new)}"


def test_known_violations_are_still_there():
    fixed = (KNOWN_UPWARD - upward_imports()) | (KNOWN_CIRCLES - circles())
    assert not fixed, f"fixed: remove from the allowlist in tests/test_layers.py: {sorted(fixed)}"


def test_the_check_catches_an_upward_import_and_a_circle():
    graph = {
        "lockstep.ddp.reducer": {"lockstep.doctor.recorder", "lockstep.distributed"},
        "lockstep.doctor.recorder": {"lockstep.doctor.records"},
        "lockstep.doctor.records": {"lockstep.doctor.recorder"},
        "lockstep.distributed": set(),
    }
    assert upward_imports(graph) == {("lockstep.ddp.reducer", "lockstep.doctor.recorder")}
    assert circles(graph) == {("lockstep.doctor.recorder", "lockstep.doctor.records")}


def test_docs_mirror_the_layer_table():
    text = (ROOT / "docs" / "contributing.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if re.match(r"\|\s*\d+\s*\|", line)]
    documented = []
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        names = re.findall(r"`([\w.]+)`", cells[2])  # written without the `lockstep.` prefix
        documented.append((cells[1], [n if n == "lockstep" else f"lockstep.{n}" for n in names]))
    assert documented == LAYERS[::-1] or documented == LAYERS, (
        "docs/contributing.md's layer table differs from LAYERS in tests/test_layers.py"
    )


# Modules kept only so that users' old imports keep working; lockstep itself imports their homes.
SHIMS = {"lockstep.multiproc", "lockstep.launcher.config", "lockstep.ddp.timing",
         "lockstep.ddp.comm_hooks", "lockstep.doctor.env", "lockstep.doctor.arrivals",
         "lockstep.launcher.plan", "lockstep.launcher.meeting",
         # hang detection, now in lockstep.diagnose
         "lockstep.progress", "lockstep.hang", "lockstep.watchdog", "lockstep.collective_checks",
         "lockstep.blame", "lockstep.stackdump", "lockstep.abort_guard"}


def test_lockstep_imports_no_compatibility_shim():
    graph = import_graph()
    users = sorted((a, b) for a, targets in graph.items() for b in targets
                   if b in SHIMS and a not in SHIMS)
    assert not users, f"import the shim's home instead (its docstring names it): {users}"


# ---- torch's private names live in lockstep._torch_compat only ------------------------------
COMPAT = ("lockstep._torch_compat", "lockstep._torch_compat_compile")
TORCH_ROOTS = {"torch", "dist", "nn", "F", "Variable", "c10d", "autograd", "distributed_c10d"}
# Private torch members reached through an object rather than a torch module.
TORCH_PRIVATE_ATTRS = {
    "_execution_engine", "_current_graph_task_id", "_unsafe_preserve_version_counter",
    "_flat_weights_names", "_flat_weights", "_get_default_store", "_state_holder",
    "_shared_tcp_store_server", "_this_node", "_orig_mod", "_flatten_dense_tensors",
    "_unflatten_dense_tensors", "_version", "_bootstrap_store_info", "_create_tcp_store_server",
}
# Modules that still read torch privates directly; each fix removes its entry.
KNOWN_PRIVATE_USERS: set[str] = set()


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _torch_imported_names(tree: ast.AST) -> set[str]:
    return {alias.asname or alias.name for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch"
            for alias in node.names}


def _defined_on_self(cls: ast.ClassDef) -> set[str]:
    """Names a class defines itself: methods, class attributes, ``self.x = ...`` targets."""
    names = {n.name for n in ast.walk(cls) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names |= {n.id for stmt in cls.body if isinstance(stmt, (ast.Assign, ast.AnnAssign))
              for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    names |= {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute)
              and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
              and n.value.id == "self"}
    return names


def _inherited_privates(tree: ast.AST) -> list[str]:
    """``self._x`` in a class derived from a torch class, where the class never defines ``_x``:
    the torch base's private member (``self._store`` in a rendezvous handler subclass)."""
    torch_names = _torch_imported_names(tree)
    found = []
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef) or not any(
                (isinstance(b, ast.Name) and b.id in torch_names) or _root(b) in TORCH_ROOTS
                for b in cls.bases):
            continue
        own = _defined_on_self(cls)
        found += [node.attr for node in ast.walk(cls)
                  if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id == "self" and _private(node.attr) and node.attr not in own]
    return found


def torch_private_uses(source: str) -> list[str]:
    """The private torch names a module's source uses (imports, attribute reads, overrides)."""
    tree = ast.parse(source)
    found = _inherited_privates(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            parts = node.module.split(".") + [a.name for a in node.names]
            found += [f"from {node.module} import ..." for p in parts if _private(p)][:1]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names
                      if a.name.split(".")[0] == "torch" and any(map(_private, a.name.split(".")))]
        elif (isinstance(node, ast.Attribute) and _private(node.attr)
              and (node.attr in TORCH_PRIVATE_ATTRS or _root(node) in TORCH_ROOTS)):
            found.append(node.attr)
        elif isinstance(node, ast.FunctionDef) and node.name in TORCH_PRIVATE_ATTRS:
            found.append(node.name)  # overriding a torch private method
    return found


def test_torch_privates_only_in_the_compat_module():
    users = {}
    for module, path in _modules().items():
        if module in COMPAT or module in KNOWN_PRIVATE_USERS:
            continue
        uses = torch_private_uses(path.read_text())
        if uses:
            users[module] = sorted(set(uses))
    assert not users, (
        "private torch names outside lockstep/_torch_compat.py: add a named function there "
        f"(with a test in tests/test_torch_compat.py) and call it: {users}"
    )


def test_known_private_users_still_use_privates():
    modules = _modules()
    fixed = [m for m in KNOWN_PRIVATE_USERS if not torch_private_uses(modules[m].read_text())]
    assert not fixed, f"remove from KNOWN_PRIVATE_USERS in tests/test_layers.py: {fixed}"


def test_the_private_check_catches_torch_privates():
    assert torch_private_uses("from torch._utils import _flatten_dense_tensors")
    assert torch_private_uses("import torch._dynamo")
    assert torch_private_uses("torch._C._current_graph_task_id()")
    assert torch_private_uses("Variable._execution_engine.queue_callback(f)")
    assert torch_private_uses("m._flat_weights_names")
    handler = ("from torch.distributed.elastic.rendezvous.dynamic_rendezvous import "
               "DynamicRendezvousHandler as H\n"
               "class R(H):\n"
               "    _mine: int = 0\n"
               "    def f(self):\n"
               "        self._seen = 1\n"
               "        return self._store, self._mine, self._seen, self._helper()\n"
               "    def _helper(self):\n"
               "        pass\n")
    assert torch_private_uses(handler) == ["_store"]
    assert torch_private_uses("class L(H):\n    def _create_tcp_store_server(self, a, p): ...")
    assert torch_private_uses("param._version")
    assert not torch_private_uses("self._reducer.clock\ntorch.autograd.grad(x, y)\nx.__class__")
