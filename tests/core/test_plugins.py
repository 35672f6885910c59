"""The plugin seam: registration, overrides, broken plugins, device selection, CLI."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import types

import pytest

from kiln import hookimpl
from kiln.platforms.base import PlatformSpec
from kiln.platforms.select import select_platform
from kiln.plugins import PluginManager
from kiln.testing.plugins import registered_attention_backend


def test_builtins_register_through_the_same_hooks(kiln_plugins):
    reg = kiln_plugins.registry
    assert "torch_ref" in reg.names("attention_backends")
    assert {"LlamaForCausalLM", "Qwen3ForCausalLM"} <= set(reg.names("models"))
    assert reg.plugins["builtin"].registered["models"]


def test_a_registered_plugin_adds_and_overrides(kiln_plugins):
    plugin = types.SimpleNamespace()

    @hookimpl
    def register_models(register):
        register("LlamaForCausalLM", "my_pkg:MyLlama")
        register("FancyForCausalLM", "my_pkg:Fancy")

    plugin.register_models = register_models
    kiln_plugins.register(plugin, name="mine")
    reg = kiln_plugins.registry
    assert reg.get("models", "LlamaForCausalLM") == "my_pkg:MyLlama"
    assert reg.plugins["mine"].registered == {"models": ["LlamaForCausalLM", "FancyForCausalLM"]}
    kiln_plugins.unregister("mine")
    assert "FancyForCausalLM" not in kiln_plugins.registry.names("models")


def test_broken_entry_point_is_reported_by_name_and_skipped(monkeypatch):
    eps = [
        importlib.metadata.EntryPoint("broken", "kiln_no_such_module_xyz", "kiln"),
        importlib.metadata.EntryPoint("cpu", "kiln_cpu.plugin", "kiln"),
    ]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: eps if group == "kiln" else [])
    pm = PluginManager()
    assert "broken" in pm.registry.errors and "ModuleNotFoundError" in pm.registry.errors["broken"]
    assert "cpu" in pm.registry.names("platforms")


def test_a_plugin_failing_inside_a_hook_does_not_stop_others(kiln_plugins):
    plugin = types.SimpleNamespace()

    @hookimpl
    def register_platforms(register):
        raise RuntimeError("boom")

    plugin.register_platforms = register_platforms
    kiln_plugins.register(plugin, name="flaky")
    reg = kiln_plugins.registry
    assert "boom" in reg.errors["flaky"]
    assert "torch_ref" in reg.names("attention_backends")


def test_load_plugins_env_limits_entry_points(monkeypatch):
    monkeypatch.setenv("KILN_LOAD_PLUGINS", "")
    assert "cpu" not in PluginManager().registry.names("platforms")
    monkeypatch.setenv("KILN_LOAD_PLUGINS", "cpu")
    assert "cpu" in PluginManager().registry.names("platforms")


@pytest.mark.parametrize("device,plugin", [("cuda", "kiln-plugin-cuda"), ("npu", "kiln-plugin-ascend")])
def test_missing_platform_names_the_plugin_to_install(kiln_plugins, device, plugin):
    with pytest.raises(ValueError, match=f"pip install {plugin}"):
        select_platform(device, kiln_plugins.registry)


def test_unavailable_platform_says_so(kiln_plugins):
    plugin = types.SimpleNamespace()

    @hookimpl
    def register_platforms(register):
        register(PlatformSpec("npu", "nowhere:Npu", is_available=lambda: False, priority=100))

    plugin.register_platforms = register_platforms
    kiln_plugins.register(plugin, name="fake-npu")
    with pytest.raises(ValueError, match="no npu device is available"):
        select_platform("npu", kiln_plugins.registry)
    with pytest.raises(ValueError, match="no platform is available"):
        select_platform("auto", kiln_plugins.registry)  # the unavailable one is skipped


def test_auto_picks_highest_priority_available():
    pm = PluginManager()
    assert select_platform("auto", pm.registry).name == "cpu"


def test_kiln_plugins_cli_lists_versions_and_registrations():
    out = subprocess.run(
        [sys.executable, "-m", "kiln.cli", "plugins", "--json"], capture_output=True, text=True, check=True
    )
    data = json.loads(out.stdout)
    by_name = {p["name"]: p for p in data["plugins"]}
    assert by_name["cpu"]["distribution"] == "kiln-plugin-cpu" and by_name["cpu"]["version"]
    assert by_name["cpu"]["registered"]["platforms"] == ["cpu"]
    assert "cpu" in by_name["cpu"]["registered"]["attention_backends"]


def test_register_commands_hook_adds_a_subcommand(monkeypatch):
    from kiln import cli, plugins

    pm = PluginManager(load_entrypoints=False)
    plugin = types.SimpleNamespace()

    @hookimpl
    def register_commands(cli):
        p = cli.add_parser("hello")
        p.set_defaults(func=lambda ns: print("hello from a plugin") or 0)

    plugin.register_commands = register_commands
    pm.register(plugin, name="greeter")
    monkeypatch.setattr(plugins, "_default", pm)
    assert cli.main(["hello"]) == 0


def test_update_engine_config_hook_sees_the_config(tiny_model_dir, monkeypatch):
    from kiln import LLM

    seen = {}
    plugin = types.SimpleNamespace()

    @hookimpl
    def update_engine_config(config):
        seen["max_model_len"] = config.max_model_len
        config.max_num_seqs = 3

    plugin.update_engine_config = update_engine_config
    pm = PluginManager()
    pm.register(plugin, name="tuner")
    from kiln.config import EngineConfig
    from kiln.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig.create(model=tiny_model_dir("llama"), max_model_len=128), plugins=pm)
    assert seen == {"max_model_len": 128} and engine.config.max_num_seqs == 3
    assert LLM  # the public API is importable alongside


def test_a_plugin_attention_backend_is_used_by_the_engine(tiny_model_dir):
    from kiln import LLM, SamplingParams
    from kiln.attention.torch_ref import TorchRefAttentionBackend

    calls = []

    class CountingBackend(TorchRefAttentionBackend):
        name = "counting"

        def forward(self, *args, **kwargs):
            calls.append(kwargs["layer_idx"])
            return super().forward(*args, **kwargs)

    with registered_attention_backend("counting", CountingBackend):
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        counted = LLM(tiny_model_dir("llama"), attention_backend="counting", max_model_len=64)
        plain = LLM(tiny_model_dir("llama"), max_model_len=64)
        assert (
            counted.generate("abc", params)[0].outputs[0].token_ids
            == plain.generate("abc", params)[0].outputs[0].token_ids
        )
        assert calls and set(calls) == {0, 1}
    with pytest.raises(ValueError, match="--attention-backend"):
        LLM(tiny_model_dir("llama"), attention_backend="counting", max_model_len=64)


def test_registration_hooks_for_parsers_templates_and_guided_backends(kiln_plugins):
    plugin = types.SimpleNamespace()

    @hookimpl
    def register_guided_backends(register):
        register("my_guided", "my_pkg.guided:Backend")

    @hookimpl
    def register_tool_parsers(register):
        register("my_tools", "my_pkg.tools:Parser")

    @hookimpl
    def register_reasoning_parsers(register):
        register("my_think", "my_pkg.think:Parser")

    @hookimpl
    def register_chat_templates(register):
        register("my_template", "{{ messages[0]['content'] }}")

    for hook in (register_guided_backends, register_tool_parsers, register_reasoning_parsers, register_chat_templates):
        setattr(plugin, hook.__name__, hook)
    kiln_plugins.register(plugin, name="extras")
    reg = kiln_plugins.registry
    assert reg.get("guided_backends", "my_guided") == "my_pkg.guided:Backend"
    assert reg.get("tool_parsers", "my_tools") == "my_pkg.tools:Parser"
    assert reg.get("reasoning_parsers", "my_think") == "my_pkg.think:Parser"
    assert reg.get("chat_templates", "my_template").startswith("{{")


def _plugin(**hooks) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{name: hookimpl(**opts)(fn) for name, (fn, opts) in hooks.items()})


def test_a_duplicate_name_warns_and_the_first_call_wins(kiln_plugins, caplog):
    """pluggy calls the later-registered plugin first; ``tryfirst`` beats registration order."""
    kiln_plugins.register(
        _plugin(register_models=(lambda register: register("X", "early:X"), {"tryfirst": True})), "early"
    )
    kiln_plugins.register(_plugin(register_models=(lambda register: register("X", "late:X"), {})), "late")
    with caplog.at_level("WARNING", logger="kiln.plugins"):
        reg = kiln_plugins.registry
    assert reg.get("models", "X") == "early:X" and reg.owners[("models", "X")] == "early"
    assert "registered by both 'early' and 'late'" in caplog.text
    assert reg.plugins["early"].registered == {"models": ["X"]} and "models" not in reg.plugins["late"].registered


def test_registration_hooks_go_through_pluggys_hook_caller(monkeypatch, caplog):
    """``KILN_TRACE_PLUGINS`` logs every registration hook call (pluggy traces its hook caller only)."""
    monkeypatch.setenv("KILN_LOAD_PLUGINS", "cpu")
    monkeypatch.setenv("KILN_TRACE_PLUGINS", "1")
    with caplog.at_level("INFO", logger="kiln.plugins"):
        assert "cpu" in PluginManager().registry.names("platforms")
    for kind in ("platforms", "attention_backends", "models"):
        assert f"register_{kind}" in caplog.text


def test_a_hookwrapper_sees_every_registration(kiln_plugins):
    seen = []

    def wrap(register):
        seen.append("before")
        yield
        seen.append("after")

    kiln_plugins.register(_plugin(register_platforms=(wrap, {"wrapper": True})), "wrapper")
    kiln_plugins.register(_plugin(register_platforms=(lambda register: seen.append("impl"), {})), "impl")
    assert kiln_plugins.registry.platforms is not None  # collecting calls every registration hook
    assert seen == ["before", "impl", "after"]


def test_an_attention_backend_runs_only_on_its_platforms(tiny_model_dir):
    from kiln import LLM, plugins
    from kiln.registry import AttentionBackendSpec

    pm = plugins.get_plugin_manager()
    pm.register(
        _plugin(
            register_attention_backends=(
                lambda register: register(
                    AttentionBackendSpec("npu_only", "kiln.attention.torch_ref:TorchRefAttentionBackend", ("npu",))
                ),
                {},
            )
        ),
        "npu-only",
    )
    try:
        with pytest.raises(ValueError, match="runs on npu, not on cpu"):
            LLM(tiny_model_dir("llama"), attention_backend="npu_only", max_model_len=64)
    finally:
        pm.unregister("npu-only")
