"""The layering of the package: the import graph has no cycles, each layer imports only the layers
below it, and the project describes the product, not the history of its making."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("dflash_jax", "kernels_pallas")

# What each layer may import (besides itself and the base modules ``sharding``, ``io.config``).
# models: pure math over ops; ops: the only importer of kernels; runtime runs models; io reads and
# writes models; serving and training sit on top.
ALLOWED = {
    "kernels_pallas": set(),
    "dflash_jax.ops": {"kernels_pallas"},
    "dflash_jax.models": {"dflash_jax.ops"},
    "dflash_jax.io": {"dflash_jax.models", "dflash_jax.ops"},
    "dflash_jax.runtime": {"dflash_jax.models", "dflash_jax.ops", "dflash_jax.io"},
}
BASE = ("dflash_jax.sharding", "dflash_jax.io.config")


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Every project module ``path`` imports, at module level or inside functions, except imports
    only a type checker runs (``if TYPE_CHECKING:``). ``from package import submodule`` imports the
    submodule (a package's ``__init__`` runs before any of its modules anyway)."""
    tree = ast.parse(path.read_text())
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{alias.name}" for alias in node.names} & modules
            found.update(subs)
            if len(subs) < len(node.names):
                found.add(node.module)
    return {name for name in found if name.split(".")[0] in PACKAGES}


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}
    return {name: {m for m in _imports(path, set(modules)) if m in modules and m != name}
            for name, path in modules.items()}


def test_import_graph_has_no_cycles():
    graph = _graph()
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt] if nxt in stack else [node, nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_each_layer_imports_only_the_layers_below():
    bad = []
    for module, imported in _graph().items():
        layer = next((layer for layer in ALLOWED if module == layer or module.startswith(layer + ".")), None)
        if layer is None:
            continue
        for name in imported:
            if name.startswith(layer) or name.startswith(BASE) or any(
                    name == ok or name.startswith(ok + ".") for ok in ALLOWED[layer]):
                continue
            if layer != "kernels_pallas" and name in ("dflash_jax",):
                continue
            bad.append(f"{module} imports {name}")
    assert not bad, "\n".join(sorted(bad))


def test_models_import_no_kernels_runtime_serving_or_training():
    forbidden = ("kernels_pallas", "dflash_jax.runtime", "dflash_jax.serving", "dflash_jax.training")
    for module, imported in _graph().items():
        if module.startswith("dflash_jax.models"):
            assert not [m for m in imported if m.startswith(forbidden)], module


_ORDINAL = (r"(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
            r"fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|thirtieth|fortieth|"
            r"fiftieth)")
_WORK_LOG = re.compile(rf"\b{_ORDINAL}[ -]+(\w+[ -]+)?sessions?\b|\b(this|last|previous|earlier|a later|next) "
                       r"session\b|\bsessions?'? (tally|log)\b", re.IGNORECASE)


def test_no_document_comment_or_test_narrates_the_work_log():
    """README, docs, code, configs and tests describe the product; git history holds the diary."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
    hits = []
    for name in files:
        if not name.endswith((".py", ".md", ".yaml", ".sh", ".toml", ".ipynb")) or not (REPO / name).is_file():
            continue
        text = (REPO / name).read_text(errors="replace")
        hits += [f"{name}: {m.group(0)}" for m in _WORK_LOG.finditer(text)]
    assert not hits, "\n".join(hits[:40])
