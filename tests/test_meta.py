"""Project-wide rules: the core knows no device, files stay small, every hook is documented."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core" / "src" / "kiln"

BLOCKER = """
import importlib.abc, sys
BLOCKED = {blocked!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED or name in BLOCKED:
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
"""


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def test_core_imports_with_device_modules_blocked():
    blocked = {"torch_npu", "torchair", "triton", "xgrammar", "flash_attn"}
    code = BLOCKER.format(blocked=blocked) + (
        "import kiln, kiln.engine.llm_engine, kiln.entrypoints.llm, kiln.cli, kiln.models.llama\n"
        "from kiln import LLM, SamplingParams\nprint('ok')"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout


def test_core_source_never_names_a_device_api():
    # torch imports torch.cuda itself, so it cannot be blocked at import time: check the source.
    offenders = [
        str(p.relative_to(ROOT))
        for p in CORE.rglob("*.py")
        if any(word in p.read_text() for word in ("torch.cuda", "torch_npu", "torch.npu", "import triton"))
    ]
    assert not offenders


def test_scheduler_and_kv_cache_do_not_import_torch():
    code = BLOCKER.format(blocked={"torch"}) + "import kiln.engine.scheduler, kiln.engine.kv_cache\nprint('ok')"
    result = run_python(code)
    assert result.returncode == 0, result.stderr


def test_core_files_stay_under_600_lines():
    too_long = {str(p.relative_to(ROOT)): n for p in CORE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert not too_long


def test_every_hook_is_documented_and_tested():
    from kiln import hookspecs

    hooks = [name for name in dir(hookspecs) if getattr(getattr(hookspecs, name), "kiln_spec", None) is not None]
    assert hooks
    docs = (ROOT / "docs" / "plugin_hooks.md").read_text()
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    for hook in hooks:
        assert f"## {hook}(" in docs, f"{hook} missing from docs/plugin_hooks.md"
        assert f"def {hook}(" in tests, f"no test implements {hook}"


@pytest.mark.parametrize("pyproject", sorted((ROOT / "plugins").glob("*/pyproject.toml")), ids=lambda p: p.parent.name)
def test_every_plugin_entry_point_loads_and_registers(pyproject):
    from kiln.plugins import PluginManager

    eps = tomllib.loads(pyproject.read_text())["project"]["entry-points"]["kiln"]
    pm = PluginManager(load_entrypoints=False)
    for name, module in eps.items():
        pm.register(__import__(module, fromlist=["_"]), name=name)
        assert any(pm.registry.plugins[name].registered.values()), f"{name} registers nothing"


@pytest.mark.parametrize("dist", sorted(p.parent for p in ROOT.glob("plugins/*/pyproject.toml")) + [ROOT / "core"])
def test_every_data_file_is_packaged(dist):
    """Files a package reads at run time (C sources and headers, templates) are in its
    package-data: an installed wheel (not an editable checkout) holds only those."""
    config = tomllib.loads((dist / "pyproject.toml").read_text())
    globs = config.get("tool", {}).get("setuptools", {}).get("package-data", {})
    for package in (dist / "src").iterdir():
        if not (package / "__init__.py").exists():
            continue
        data = [f for f in package.rglob("*") if f.is_file() and f.suffix not in (".py", ".pyc")]
        packaged = {f for pattern in globs.get(package.name, []) for f in package.glob(pattern)}
        assert not [str(f.relative_to(dist)) for f in data if f not in packaged]


# ---------------------------------------------------------------- module boundaries
SOURCES = [
    ROOT / "core" / "src",
    *sorted((ROOT / "plugins").glob("*/src")),
    ROOT / "examples" / "plugin_example" / "src",
]
PLUGIN_SOURCES = SOURCES[1:]
STABLE_FOR_PLUGINS = ("kiln", "kiln.registry", "kiln.interfaces", "kiln.testing")


def module_files() -> dict[str, Path]:
    """Every module of the core and the plugins by dotted name."""
    out = {}
    for src in SOURCES:
        for path in src.rglob("*.py"):
            parts = list(path.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules ``name`` imports anywhere in its file: top level, inside functions, under
    ``TYPE_CHECKING``. ``from a import b`` counts as ``a.b`` when that is a module."""
    import ast

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m in known or m.split(".")[0] in {k.split(".")[0] for k in known}}


@pytest.fixture(scope="module")
def import_graph() -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    return {name: imports_of(name, path, known) for name, path in files.items()}


def test_no_import_cycles(import_graph):
    """No module reaches itself through imports of any kind (Tarjan's strongly connected components)."""
    graph = {m: {d for d in deps if d in import_graph and d != m} for m, deps in import_graph.items()}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles


def test_interfaces_import_nothing_of_the_engine_worker_or_models(import_graph):
    forbidden = ("kiln.engine", "kiln.worker", "kiln.models", "kiln.entrypoints")
    bad = {
        m: sorted(d for d in deps if d.startswith(forbidden))
        for m, deps in import_graph.items()
        if m.startswith("kiln.interfaces")
    }
    assert not {m: d for m, d in bad.items() if d}


def test_plugins_import_only_the_stable_paths(import_graph):
    """Plugins see ``kiln``, ``kiln.registry``, ``kiln.interfaces.*`` and ``kiln.testing``: the
    engine's insides can move without breaking them."""
    own = {path.name for src in PLUGIN_SOURCES for path in src.iterdir() if (path / "__init__.py").exists()}
    bad = {}
    for m, deps in import_graph.items():
        if m.split(".")[0] not in own:
            continue
        outside = [
            d
            for d in deps
            if d.split(".")[0] == "kiln"
            and not any(d == s or d.startswith(s + ".") for s in STABLE_FOR_PLUGINS[1:])
            and d != "kiln"
        ]
        if outside:
            bad[m] = outside
    assert not bad


@pytest.mark.parametrize(
    "code",
    [
        "import kiln.registry, kiln.plugins\nfrom kiln.plugins import PluginManager\n"
        "reg = PluginManager().registry\nassert 'cpu' in reg.names('platforms'), reg.errors\nassert not reg.errors, reg.errors",
        "from kiln.cli import main\nmain(['plugins'])",
        "from kiln.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit as exit:\n    assert exit.code == 0",
        "import kiln.engine.request, kiln.engine.scheduler, kiln.engine.kv_cache, kiln.engine.input_processor, "
        "kiln.engine.output_processor, kiln.engine.engine_core, kiln.engine.guided_manager, kiln.interfaces.guided",
    ],
    ids=["registry-and-plugins", "kiln-plugins-command", "kiln-help", "torch-free-engine-side"],
)
def test_torch_free_modules_import_with_torch_blocked(code):
    result = run_python(BLOCKER.format(blocked={"torch"}) + code)
    assert result.returncode == 0, result.stderr


def test_finished_statuses_are_set_in_one_module():
    """A request's status is assigned only by the scheduler: one rule for where a request ends."""
    import ast

    setters = set()
    for path in CORE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if any(isinstance(t, ast.Attribute) and t.attr == "status" for t in targets):
                setters.add(path.relative_to(CORE).as_posix())
    assert setters == {"engine/scheduler.py"}


def test_the_core_step_stays_short():
    """``EngineCore.step`` reads like nano-vllm's: schedule, execute, bitmask, sample, update."""
    import inspect

    from kiln.engine.engine_core import EngineCore

    assert len(inspect.getsource(EngineCore.step).splitlines()) <= 20
