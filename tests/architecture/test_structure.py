"""Structure rules checked on the source: no import cycle anywhere in the package, and one writer of
action and approval state (docs/ARCHITECTURE.md "Module map", "Action states")."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "aip_crewai"

#: Store methods that change an action's state or an approval's status.
STATE_WRITES = {
    "create_action",
    "update_action",
    "create_approval",
    "decide_approval",
    "decide_and_start",
    "cancel_pending",
    "expire_approvals",
}
#: The modules allowed to call them: the writer, and the storage modules that define them.
WRITERS = {
    "aip_crewai.host.actions.writer",
    "aip_crewai.host.store.store",
    "aip_crewai.host.store.approvals",
    "aip_crewai.host.store.records",
    "aip_crewai.host.store.engines.engine",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """Every package module ``name`` imports, at any level (TYPE_CHECKING and function bodies included)."""
    package = (
        name
        if name in known and (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()
        else name.rpartition(".")[0]
    )
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and not (PACKAGE.parent / target.replace(".", "/") / "__init__.py").exists():
                found.add(target)
    return found


def test_no_import_cycle_in_the_package():
    """Regression: host actions, cancellation and recovery imported each other in a cycle."""
    trees = modules()
    known = set(trees)
    graph = {name: imports(name, tree, known) for name, tree in trees.items()}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt) :] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_only_the_writer_changes_action_or_approval_state():
    """Every call of a store state write is in the writer (or the storage modules themselves)."""
    offenders = []
    for name, tree in modules().items():
        if name in WRITERS:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in STATE_WRITES:
                offenders.append(f"{name}:{node.lineno} {node.attr}")
    assert offenders == []


def test_no_private_method_of_another_object_is_called_in_the_host():
    """The lifecycle functions use the runtime's public interface (no ``service._x`` calls)."""
    offenders = []
    for name, tree in modules().items():
        if not name.startswith("aip_crewai.host."):
            continue
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name)
                and node.value.id in ("service", "runtime")
            ):
                offenders.append(f"{name}:{node.lineno} {node.value.id}.{node.attr}")
    assert offenders == []


def test_no_bounded_wait_uses_asyncio_wait_for():
    """A bounded wait is ``anyio.fail_after`` or ``anyio.move_on_after`` around the await, never
    ``asyncio.wait_for`` (nor ``asyncio.timeout``, absent on Python 3.10): before Python 3.12 ``wait_for``
    returns the result of an awaitable that completes as its caller is cancelled, dropping the
    cancellation, and a loop around it (the webhook sender polling the store) never stops
    (plumbing/wakeup.py)."""
    offenders = [
        f"{name}:{node.lineno}"
        for name, tree in modules().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr in ("wait_for", "timeout")
        and isinstance(node.value, ast.Name)
        and node.value.id == "asyncio"
    ]
    assert offenders == []
