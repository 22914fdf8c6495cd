"""The shape of the packages (docs/architecture.md, "Packages and dependencies"), checked on the
source: which package may import which, no import circles (type-only ones included), no module
too long to read, a public API that does not load torch, one door for a turn's session, and a
manager that is a front (the faces are handed the services beside it)."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import REPO

PACKAGES = ("sessions", "cache", "storage", "app")
MAX_MODULE_LINES = 600


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            if "migrations" in path.parts and "versions" in path.parts:
                continue
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _imports(path: Path) -> Iterator[tuple[str, str]]:
    """(imported module, the statement's `from` part) of every import in the file, wherever it
    is (function bodies and `if TYPE_CHECKING:` blocks included)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                target = f"{node.module}.{alias.name}"
                yield (target if target in MODULES else node.module), node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, alias.name


def _ours(module: str) -> str | None:
    top = module.split(".")[0]
    return top if top in PACKAGES else None


def test_the_faces_go_through_the_sessions_package_only() -> None:
    wrong = [
        f"{name} imports {source}"
        for name, path in MODULES.items()
        if name.startswith("app")
        for _, source in _imports(path)
        if _ours(source) not in (None, "app") and source != "sessions"
    ]
    assert wrong == []


def test_cache_and_storage_import_nothing_above_them_nor_each_other() -> None:
    allowed = {"cache": {"cache"}, "storage": {"storage"}}
    wrong = [
        f"{name} imports {target}"
        for name, path in MODULES.items()
        if _ours(name) in allowed
        for target, _ in _imports(path)
        if _ours(target) is not None and _ours(target) not in allowed[_ours(name) or ""]
    ]
    assert wrong == []


def test_no_module_imports_itself_back_through_others() -> None:
    graph = {
        name: {target for target, _ in _imports(path) if target in MODULES and target != name}
        for name, path in MODULES.items()
    }
    # A package's own `__init__` re-exporting its modules is not a circle through them.
    for name in graph:
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".")}
    circles = [component for component in _strongly_connected(graph) if len(component) > 1]
    assert circles == []


def test_no_module_is_longer_than_a_reader_keeps_in_mind() -> None:
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


SESSION_DECIDING = {"open_session", "fork", "continue_history", "stream_chat", "chat", "route_turn"}
"""`SessionManager` methods that choose, make or run on a session outright."""
EXPLICIT_SESSION_CALLS = {
    ("app.http.session_api", "create_session"),  # POST /v1/sessions
    ("app.http.session_api", "fork"),  # POST /v1/sessions/{id}/fork
    ("app.http.session_api", "owner_answer"),  # where such a request goes among replicas
    ("app.ui.handlers", "new_session"),  # the chat page's New session button (a title, no turn)
}
"""(module, function) of the calls that make a session on their user's request, not for a turn."""


def _calls_by_function(path: Path) -> Iterator[tuple[str, str]]:
    """(innermost enclosing function, called attribute) of every `x.attr(...)` call in the file."""

    def visit(node: ast.AST, function: str) -> Iterator[tuple[str, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute):
                yield function, child.func.attr
            inner = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else function
            yield from visit(child, inner)

    return visit(ast.parse(path.read_text()), "<module>")


def test_only_the_explicit_session_requests_choose_a_turns_session() -> None:
    """Where a turn runs is decided once, in `sessions` (`SessionManager.plan_turn`, issue 30):
    every face (the HTTP routes, the chat page, `chatkv chat`) builds a `TurnTarget` and runs the
    plan, and never opens, forks or picks a session to decide a turn; only a request to make a
    session (`EXPLICIT_SESSION_CALLS`) makes one outright."""
    wrong = [
        f"{name}.{function} calls .{attr}()"
        for name, path in MODULES.items()
        if name.startswith("app")
        for function, attr in _calls_by_function(path)
        if attr in SESSION_DECIDING and (name, function) not in EXPLICIT_SESSION_CALLS
    ]
    assert wrong == []


BESIDE_THE_MANAGER = {"responses", "conversations", "idempotency", "metrics", "internals"}
"""The services the composition root hands the faces beside the manager (`sessions.Services`),
and the root's parts, which only tests look into."""
MAX_EXPORTS = 72
"""`sessions.__all__`: what a user of the package needs (77 names before issue 30)."""


def test_the_manager_is_a_front() -> None:
    """`SessionManager` holds no parts in public attributes, and no face reaches a service or
    the root's parts through a manager (`manager.responses.`, `self._manager.internals`, ...):
    the faces take `Services` (issue 30)."""
    manager = ast.parse((REPO / "sessions" / "manager.py").read_text())
    public = {
        target.attr
        for node in ast.walk(manager)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"
    }
    assert {name for name in public if not name.startswith("_")} == {"settings"}
    wrong = [
        f"{name}:{node.lineno} reaches {ast.unparse(node)}"
        for name, path in MODULES.items()
        if name.startswith("app")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in BESIDE_THE_MANAGER and "manager" in ast.unparse(node.value)
    ]
    assert wrong == []


def test_the_package_exports_what_its_users_need() -> None:
    import sessions

    assert len(sessions.__all__) <= MAX_EXPORTS
    # One name for each thing: a held home is `HomeLocked`, not also the storage layer's error.
    assert "HomeLockedError" not in sessions.__all__


def test_the_public_api_imports_no_torch() -> None:
    """`import sessions` (settings, records, errors, the admin operations) starts fast: the CLI
    talking to a server, and offline admin commands, never load torch or Gradio."""
    probe = "import sys, sessions; print(sorted(m for m in ('torch', 'transformers', 'gradio') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively (the module graph is deep)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components
