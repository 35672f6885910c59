"""The ``kiln`` command line: ``kiln generate``, ``kiln plugins``, and plugin-added commands."""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys

import kiln
from kiln.engine_args import add_engine_args, engine_kwargs


def cmd_plugins(ns: argparse.Namespace) -> int:
    from kiln.plugins import get_plugin_manager

    reg = get_plugin_manager().registry
    rows = [
        {
            "name": info.name,
            "distribution": info.distribution,
            "version": info.version,
            "registered": info.registered,
        }
        for info in reg.plugins.values()
    ]
    if ns.json:
        print(json.dumps({"plugins": rows, "errors": reg.errors}, indent=2))
        return 0
    for row in rows:
        print(f"{row['name']}  ({row['distribution']} {row['version']})")
        for kind, names in row["registered"].items():
            print(f"    {kind}: {', '.join(names)}")
    for name, err in reg.errors.items():
        print(f"{name}  FAILED TO LOAD: {err}")
    return 0


def cmd_generate(ns: argparse.Namespace) -> int:
    from kiln import LLM, LoRARequest, SamplingParams

    flags = engine_kwargs(ns)
    lora = None
    if ns.lora is not None:
        flags["enable_lora"] = True
        lora = LoRARequest("cli", 1, ns.lora)
    llm = LLM(ns.model, **flags)
    params = SamplingParams(
        max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, seed=ns.seed_sampling
    )
    if ns.chat:
        out = llm.chat([{"role": "user", "content": ns.prompt}], params, lora_request=lora)[0]
    else:
        out = llm.generate(ns.prompt, params, lora_request=lora)[0]
    print(out.outputs[0].text)
    return 0


def cmd_serve(ns: argparse.Namespace) -> int:
    from kiln.entrypoints.openai.api_server import run_server

    return run_server(ns)


def cmd_quantize(ns: argparse.Namespace) -> int:
    from kiln.quantization.tool import cmd_quantize as run

    return run(ns)


def cmd_convert_eagle(ns: argparse.Namespace) -> int:
    from kiln.spec_decode.convert_eagle import cmd_convert_eagle as run

    return run(ns)


def cmd_bench_serve(ns: argparse.Namespace) -> int:
    from kiln.benchmarks.serve import cmd_bench_serve as run

    return run(ns)


BENCH_SERVE_HELP = (
    "Send synthetic prompts (random, or sharing a prefix) to a server's /v1/completions, streaming, at a fixed "
    "concurrency or Poisson rate; report throughput and TTFT/TPOT/ITL as a table and JSON."
)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    from kiln.benchmarks.serve import add_bench_serve_args
    from kiln.entrypoints.openai.cli_args import add_serve_args, apply_config_file
    from kiln.plugins import get_plugin_manager
    from kiln.quantization.cli_args import HELP as QUANTIZE_HELP
    from kiln.quantization.cli_args import add_quantize_args
    from kiln.spec_decode.convert_eagle import HELP as EAGLE_HELP
    from kiln.spec_decode.convert_eagle import add_convert_eagle_args

    parser = argparse.ArgumentParser(prog="kiln", description="Kiln LLM serving engine")
    parser.add_argument("--version", action="version", version=f"kiln {kiln.__version__}")
    parser.add_argument(
        "--log-level", default=None, help="python logging level (default: INFO for serve, else WARNING)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser(
        "serve",
        help="serve a model over the OpenAI-compatible HTTP API",
        description="Serve a model over the OpenAI-compatible API (vLLM's endpoints, fields and flags).",
    )
    add_serve_args(s)
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    bs = b.add_parser(
        "serve",
        help="benchmark an OpenAI-compatible server (throughput, TTFT, TPOT, ITL)",
        description=BENCH_SERVE_HELP,
    )
    add_bench_serve_args(bs)
    bs.set_defaults(func=cmd_bench_serve)
    if argv is not None and "serve" in argv:
        apply_config_file(s, argv)

    q = sub.add_parser("quantize", help="make a quantized copy of a model", description=QUANTIZE_HELP)
    add_quantize_args(q)
    q.set_defaults(func=cmd_quantize)

    c = sub.add_parser("convert-eagle", help="make an EAGLE-1 head whole, as vLLM 0.6 reads it", description=EAGLE_HELP)
    add_convert_eagle_args(c)
    c.set_defaults(func=cmd_convert_eagle)

    p = sub.add_parser("plugins", help="list installed plugins, their versions and what each registered")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_plugins)

    g = sub.add_parser("generate", help="generate a completion offline and print it")
    g.add_argument("prompt")
    g.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--sampling-seed", dest="seed_sampling", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.add_argument("--lora", default=None, help="a PEFT LoRA adapter folder to generate with (turns on --enable-lora)")
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)

    get_plugin_manager().register_commands(sub)
    return parser


def dashed(argv: list[str]) -> list[str]:
    """``--long_flag`` spelled ``--long-flag``, as vLLM reads it (models' cards write
    ``--tokenizer_mode mistral``); values, and anything after ``--``, stay as they are."""
    out = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        flag, eq, value = arg.partition("=")
        if re.fullmatch(r"--[\w-]+", flag):  # a flag, not a value that starts with --
            arg = flag.replace("_", "-") + eq + value
        out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = dashed(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    ns = parser.parse_args(argv)
    level = ns.log_level or ("INFO" if ns.command == "serve" else "WARNING")
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return ns.func(ns) or 0
    except ValueError as exc:
        print(f"kiln: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
