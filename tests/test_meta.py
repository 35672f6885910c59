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
