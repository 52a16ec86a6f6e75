"""Package structure: imports run one way, and the documented submodules load with the package.

The layers, bottom to top (``LAYERS``): a module imports from its own layer or the ones below, never
from above, and no set of modules imports each other (a submodule importing its own package's
``__init__`` counts as a circle, since the package imports it).

The direction checks read the source with ``ast`` rather than importing it, so they see imports in
every branch (``if HAS_TRITON:``) and inside functions (lazy imports) too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "te_compile"

# Bottom to top; a name stands for the module or the package and everything in it, and the longest
# name that matches places a module. The eager features (FSDP2's FP8 all-gather, FP8 primary
# weights) and quantization.py, their weight quantizer, sit beside the lowerings, above the GEMM
# layer whose operand quantizers (gemm/block.py) both use.
LAYERS = [
    ["te_compile.recipe", "te_compile.scaling", "te_compile.hardware", "te_compile.norm_spec",
     "te_compile.report", "te_compile.eager_experts", "te_compile.library_warnings", "te_compile.numerics",
     "te_compile.torchao_peer", "te_compile.autocast"],
    ["te_compile.kernels"],
    ["te_compile.distributed", "te_compile.state", "te_compile.config", "te_compile.context_parallel",
     "te_compile.pipeline", "te_compile.memory"],
    ["te_compile.tensor"],
    ["te_compile.custom_recipes"],
    ["te_compile.gemm"],
    # graph-only helpers: below every pass and lowering that may walk a graph
    ["te_compile.fx"],
    # the ways one linear executes: below the lowerings that pick one (linear.py) or call its GEMMs
    ["te_compile.lowerings.linear_paths"],
    ["te_compile.lowerings", "te_compile.quantization", "te_compile.fsdp", "te_compile.primary_weights",
     "te_compile.weight_cache", "te_compile.calibration", "te_compile.kv_cache"],
    ["te_compile.passes"],
    ["te_compile.backend"],
    ["te_compile", "te_compile.cli", "te_compile.models", "te_compile.data", "te_compile.__main__"],
]


def _module_names(package_dir: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module of the package (a package's name maps to __init__.py)."""
    root = package_dir.parent
    names = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules ``name`` imports anywhere in its file, absolute or relative.

    ``from X import a`` counts as importing X.a when that is a module, else X. Parent packages,
    which Python imports first anyway, are left out, so ``from . import utils`` is an edge to
    ``utils`` only.
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return found


def _import_graph(package_dir: Path = PACKAGE_DIR) -> dict[str, set[str]]:
    """Module -> the package's own modules it imports."""
    modules = _module_names(package_dir)
    return {
        name: {m for m in _imported_modules(name, path, modules) if m in modules}
        for name, path in modules.items()
    }


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def layer_of(name: str) -> int:
    """The index in ``LAYERS`` of the longest entry that is ``name`` or a package holding it."""
    matches = [(len(entry), i) for i, layer in enumerate(LAYERS) for entry in layer
               if name == entry or name.startswith(entry + ".")]
    if not matches:
        raise KeyError(f"{name} is in no layer of LAYERS: place it there")
    return max(matches)[1]


def upward_imports(package_dir: Path = PACKAGE_DIR) -> list[str]:
    """"a -> b" for every import of a module of a higher layer than the importer's."""
    graph = _import_graph(package_dir)
    return [f"{m} -> {d}" for m, deps in sorted(graph.items()) for d in sorted(deps) if layer_of(d) > layer_of(m)]


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Sets of modules that import each other (strongly connected components of ``graph`` with more
    than one module, or a module importing itself)."""
    # Tarjan's algorithm; the package is small, recursion depth is not a concern.
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def kernels_importing_tensor(package_dir: Path = PACKAGE_DIR) -> list[list[str]]:
    """Import chains from a module of te_compile.kernels to te_compile.tensor (direct or through
    other modules such as te_compile.scaling)."""
    graph = _import_graph(package_dir)
    chains = []
    for start in sorted(m for m in graph if _under(m, "te_compile.kernels")):
        # breadth-first over explicit imports, remembering how each module was reached
        seen = {start: [start]}
        frontier = [start]
        while frontier:
            nxt = []
            for mod in frontier:
                for dep in sorted(graph[mod]):
                    if dep in seen:
                        continue
                    seen[dep] = seen[mod] + [dep]
                    if _under(dep, "te_compile.tensor"):
                        chains.append(seen[dep])
                    else:
                        nxt.append(dep)
            frontier = nxt
    return chains


def tensor_import_cycles(package_dir: Path = PACKAGE_DIR) -> list[list[str]]:
    """Sets of te_compile.tensor modules that import each other."""
    graph = {
        m: {d for d in deps if _under(d, "te_compile.tensor")}
        for m, deps in _import_graph(package_dir).items()
        if _under(m, "te_compile.tensor")
    }
    return import_cycles(graph)


def test_graph_sees_relative_and_lazy_imports():
    # the checks below are only as good as the graph: spot-check edges of each import form
    graph = _import_graph()
    assert "te_compile.scaling" in graph["te_compile.kernels.float8_block_quantize"]  # from ..scaling
    assert "te_compile.kernels._fp_bits" in graph["te_compile.kernels.nvfp4_quantize"]  # in `if`
    assert "te_compile.tensor.utils" in graph["te_compile.tensor"]  # from . import utils
    assert "te_compile.tensor.float8_tensor" in graph["te_compile.tensor.utils"]


def test_kernels_do_not_import_tensor():
    chains = kernels_importing_tensor()
    assert not chains, "te_compile.kernels must not import te_compile.tensor; found: " + "; ".join(
        " -> ".join(chain) for chain in chains
    )


def test_no_import_cycles_in_tensor():
    cycles = tensor_import_cycles()
    assert not cycles, "modules of te_compile.tensor import each other: " + "; ".join(
        " <-> ".join(c) for c in cycles
    )


def test_every_module_has_a_layer_and_no_import_runs_back_up():
    graph = _import_graph()
    for name in graph:
        layer_of(name)   # raises for a module no layer names
    up = upward_imports()
    assert not up, "imports from a higher layer (tests/test_imports.py LAYERS): " + "; ".join(up)


def test_no_modules_import_each_other():
    cycles = import_cycles(_import_graph())
    assert not cycles, "modules that import each other: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_layer_checks_see_an_upward_import_and_a_circle(tmp_path):
    # a copy of the package with one import added at the bottom: both checks must name it
    import shutil

    copy = tmp_path / "te_compile"
    shutil.copytree(PACKAGE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    with (copy / "recipe.py").open("a") as f:
        f.write("\nfrom .passes.linear import rewrite_linears\n")
    assert "te_compile.recipe -> te_compile.passes.linear" in upward_imports(copy)
    assert any("te_compile.recipe" in c for c in import_cycles(_import_graph(copy)))


def test_eager_features_import_neither_passes_nor_lowerings():
    graph = _import_graph()
    for name in ("te_compile.fsdp", "te_compile.primary_weights"):
        reached = {d for d in graph[name] if _under(d, "te_compile.passes") or _under(d, "te_compile.lowerings")}
        assert not reached, f"{name} imports {sorted(reached)}"


def test_import_te_compile_loads_tensor_utils():
    # A fresh interpreter: in this one another test may already have imported te_compile.tensor.utils.
    code = "import te_compile; print(te_compile.tensor.utils.is_custom(object()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=PACKAGE_DIR.parent)
    assert out.returncode == 0, f"`{code}` failed (exit {out.returncode}):\n{out.stderr[-3000:]}"
    assert out.stdout.strip() == "False", f"`{code}` printed {out.stdout!r}"
