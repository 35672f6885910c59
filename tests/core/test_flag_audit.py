"""Flags that once parsed and did nothing: each now acts, warns, or is refused with a message."""

from __future__ import annotations

import argparse
import logging
import ssl

import pytest

from kiln.config import EngineConfig
from kiln.engine.llm_engine import LLMEngine
from kiln.entrypoints.openai.api_server import _iteration_timeout, resolve_parsers
from kiln.entrypoints.openai.cli_args import add_serve_args
from kiln.entrypoints.openai.tls import check_tls_args


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser.parse_args(list(argv))


def test_graph_flags_on_a_platform_without_graphs_say_so(tiny_model_dir, caplog):
    model = tiny_model_dir("llama")
    with caplog.at_level(logging.WARNING, logger="kiln.runner"):
        LLMEngine(EngineConfig.create(model=model, device="cpu", graph_sizes=[1, 2], max_seq_len_to_capture=64))
    assert "no graph mode" in caplog.text
    assert "--graph-sizes, --max-seq-len-to-capture change nothing" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kiln.runner"):
        LLMEngine(EngineConfig.create(model=model, device="cpu"))
    assert "no graph mode" not in caplog.text  # defaults: nothing to warn about


def test_enable_reasoning_is_a_deprecated_alias(caplog):
    with pytest.raises(ValueError, match="--enable-reasoning: needs --reasoning-parser"):
        resolve_parsers(serve_args("--enable-reasoning"))
    with caplog.at_level(logging.WARNING, logger="kiln.server"):
        _, parser = resolve_parsers(serve_args("--enable-reasoning", "--reasoning-parser", "deepseek_r1"))
    assert parser is not None and "deprecated" in caplog.text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--ssl-cert-reqs", "2"], "--ssl-cert-reqs: needs TLS (--ssl-certfile)"),
        (["--enable-ssl-refresh"], "--enable-ssl-refresh: needs TLS"),
        (["--ssl-ca-certs", "ca.pem"], "--ssl-ca-certs: needs TLS"),
        (["--ssl-keyfile", "k.pem"], "--ssl-keyfile: needs --ssl-certfile"),
        (["--ssl-certfile", "/no/such.pem"], "--ssl-certfile: no such file"),
    ],
)
def test_tls_flags_are_checked_before_the_model_loads(argv, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_tls_args(serve_args(*argv))


def test_client_certificates_need_a_ca(tmp_path):
    cert = tmp_path / "cert.pem"
    cert.write_text("x")
    args = serve_args("--ssl-certfile", str(cert), "--ssl-cert-reqs", str(ssl.CERT_REQUIRED))
    with pytest.raises(ValueError, match="verified against --ssl-ca-certs"):
        check_tls_args(args)


@pytest.mark.parametrize("value, expected", [("60", 60.0), ("0.5", 0.5), ("0", None)])
def test_iteration_timeout(monkeypatch, value, expected):
    monkeypatch.setenv("KILN_ENGINE_ITERATION_TIMEOUT_S", value)
    assert _iteration_timeout() == expected


@pytest.mark.parametrize("value", ["soon", "-1", "nan", "inf"])
def test_bad_iteration_timeout_is_refused(monkeypatch, value):
    monkeypatch.setenv("KILN_ENGINE_ITERATION_TIMEOUT_S", value)
    with pytest.raises(ValueError, match="KILN_ENGINE_ITERATION_TIMEOUT_S"):
        _iteration_timeout()


@pytest.mark.parametrize("flag", ["--max-queued-requests", "--max-request-body-bytes"])
def test_counts_must_not_be_negative(flag, capsys):
    with pytest.raises(SystemExit):
        serve_args(flag, "-1")
    assert "expected a count >= 0" in capsys.readouterr().err


def test_priority_needs_the_priority_policy_offline_too(tiny_model_dir):
    from kiln import LLM, SamplingParams

    llm = LLM(model=tiny_model_dir("llama"), device="cpu")
    with pytest.raises(ValueError, match="priority: only allowed with --scheduling-policy priority"):
        llm.generate(["hi"], SamplingParams(max_tokens=2), priority=[1])
    assert llm.generate(["hi"], SamplingParams(max_tokens=2), priority=[0])[0].outputs[0].token_ids


def test_null_generation_defaults_are_no_defaults(tmp_path):
    from kiln.models.loader import load_generation_defaults

    (tmp_path / "generation_config.json").write_text('{"temperature": null, "top_p": 0.9, "eos_token_id": 2}')
    assert load_generation_defaults(str(tmp_path), "auto") == {"top_p": 0.9, "eos_token_ids": [2]}


def test_underscored_flags_read_as_vllm_reads_them():
    from kiln.cli import build_parser, dashed

    argv = ["serve", "org/my_model", "--tokenizer_mode", "mistral", "--max_model_len=128", "--", "--keep_this"]
    assert dashed(argv) == ["serve", "org/my_model", "--tokenizer-mode", "mistral", "--max-model-len=128", "--",
                            "--keep_this"]  # fmt: skip
    assert dashed(["generate", "--prompt", "--not a_flag"]) == ["generate", "--prompt", "--not a_flag"]
    argv = dashed(["serve", "org/my_model", "--tokenizer_mode", "mistral", "--max_model_len=128"])
    ns = build_parser(argv).parse_args(argv)
    assert (ns.model_tag, ns.tokenizer_mode, ns.max_model_len) == ("org/my_model", "mistral", 128)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["m", "--multi-step-stream-outputs", "false"], False),
        (["m", "--multi-step-stream-outputs=True"], True),
        (["m", "--multi-step-stream-outputs"], True),
        (["m", "--no-multi-step-stream-outputs"], False),
        (["--multi-step-stream-outputs", "FALSE", "m"], False),
    ],
)
def test_switches_vllm_spells_with_a_value_take_one(argv, expected):
    args = serve_args(*argv)
    assert args.multi_step_stream_outputs is expected and args.model_tag == "m"


def test_a_switch_with_a_value_not_true_or_false_is_refused(capsys):
    with pytest.raises(SystemExit):
        serve_args("m", "--enable-chunked-prefill", "maybe")
    assert "--enable-chunked-prefill: expected true or false, got 'maybe'" in capsys.readouterr().err


def test_seed_001s_start_command_parses(tmp_path):
    # Seed 001's canonical flags (its start command for Ascend), with multi-step scheduling.
    args = serve_args(
        "--model", "m", "--max-num-seqs=256", "--max-model-len=4096", "--max-num-batched-tokens=4096",
        "--tensor-parallel-size=1", "--block-size=128", "--gpu-memory-utilization=0.9", "--num-scheduler-steps=8",
        "--trust-remote-code", "--enforce-eager",
    )  # fmt: skip
    config = EngineConfig.create(**{k: v for k, v in vars(args).items() if k in EngineConfig.model_fields})
    assert config.num_scheduler_steps == 8 and config.multi_step_stream_outputs
