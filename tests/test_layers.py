"""The import rule of tk's layers: imports run downward only, export and runtime never import each
other, and no module imports itself back through others. Every import counts, also those inside
functions: a lazy import upward is still an upward dependency."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "tk"

# lowest first; a module may import from its own layer and the layers listed before it
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "base",
        (
            "tk",
            "tk.errors",
            "tk.registries",
            "tk.spec",
            "tk.fileio",
            "tk.versions",
            "tk.tolerances",
            "tk.manifest",
            "tk.parity",
            "tk.generation_parity",
            "tk.limits",
            "tk.accuracy",
            "tk.signing",
        ),
    ),
    ("models", ("tk.models",)),
    ("formats", ("tk.formats",)),
    ("export", ("tk.export",)),
    ("runtime", ("tk.runtime",)),
    ("measure", ("tk.measure",)),
    ("workflows", ("tk.workflows",)),
    ("serve", ("tk.serve",)),
    ("cli", ("tk.cli", "tk.__main__")),
]
PEERS = {"export": "runtime", "runtime": "export"}  # same height, neither imports the other


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str:
    best = ("", "")
    for layer, prefixes in LAYERS:
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best[1]):
                best = (layer, prefix)
    if not best[0]:
        raise AssertionError(f"{module} belongs to no layer: add it to LAYERS in {Path(__file__).name}")
    return best[0]


RANK = {layer: i for i, (layer, _) in enumerate(LAYERS)}
RANK["runtime"] = RANK["export"]


def tk_imports(path: Path) -> set[str]:
    """Every ``tk`` module ``path`` imports, anywhere in the file."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "tk")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            if base.split(".")[0] != "tk":
                continue
            for alias in node.names:  # ``from tk.models import train`` imports the submodule
                candidate = f"{base}.{alias.name}"
                found.add(candidate if (ROOT.parent / (candidate.replace(".", "/") + ".py")).exists() else base)
    return found


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
GRAPH = {name: {m for m in tk_imports(path) if m in MODULES and m != name} for name, path in MODULES.items()}


def rule_broken(module: str, target: str) -> str | None:
    """Why ``module`` may not import ``target``, or None when it may."""
    mine, theirs = layer_of(module), layer_of(target)
    if PEERS.get(mine) == theirs:
        return f"{module} ({mine}) imports {target} ({theirs}): peers never import each other"
    if RANK[theirs] > RANK[mine]:
        return f"{module} ({mine}) imports {target} from the higher layer {theirs}"
    return None


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_run_downward(module):
    broken = [rule_broken(module, target) for target in sorted(GRAPH[module])]
    assert not any(broken), [b for b in broken if b]


def test_no_import_cycles():
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt) :], nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module)


def test_the_rule_catches_upward_and_peer_imports():
    assert "higher layer workflows" in rule_broken("tk.spec", "tk.workflows.check")
    assert "higher layer runtime" in rule_broken("tk.formats.aoti", "tk.runtime.aoti")
    assert "peers never import each other" in rule_broken("tk.runtime.aoti", "tk.export.aoti.writer")
    assert "peers never import each other" in rule_broken("tk.export", "tk.runtime")
    assert rule_broken("tk.cli.run", "tk.spec") is None
    assert rule_broken("tk.workflows.check", "tk.runtime.inputs") is None


def test_imports_inside_functions_count():
    # the registry imports the model modules only inside _entries(), and tk.cli its commands inside _register()
    assert {"tk.models.linear", "tk.models.transformer"} <= tk_imports(ROOT / "models" / "registry.py")
    assert {"tk.cli.run", "tk.cli.serve"} <= tk_imports(ROOT / "cli" / "__init__.py")
