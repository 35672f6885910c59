"""Helpers for tests that run the whole engine, e.g. a plugin's code path against the CPU plugin."""

from __future__ import annotations

from typing import Any


def make_engine(plugins, **engine_args: Any):
    """An ``LLMEngine`` built with ``plugins`` (a ``PluginManager``) and ``engine_args``
    (``model``, ``device``, ``dtype``...)."""
    from kiln.config import EngineConfig
    from kiln.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig.create(**engine_args), plugins=plugins)


def run_greedy(engine, prompts: list[list[int]], max_tokens: int = 8, loras: list | None = None) -> list[list[int]]:
    """Greedy output token ids of ``prompts`` (token-id lists), batched on ``engine``; ``loras``:
    each prompt's ``LoRARequest`` (or None)."""
    from kiln.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        lora = None if loras is None else loras[i]
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params, lora_request=lora)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out.outputs[0].token_ids
    return [done[str(i)] for i in range(len(prompts))]


def run_and_shut_down(plugins, prompts: list[list[int]], **engine_args: Any) -> tuple[list[list[int]], Any]:
    """``run_greedy`` on a fresh engine, shut down afterwards (its tensor-parallel ranks stopped);
    returns (the tokens, the engine, for its shapes)."""
    engine = make_engine(plugins, **engine_args)
    try:
        return run_greedy(engine, prompts), engine
    finally:
        engine.shutdown()


def greedy_tokens(
    plugins, prompts: list[list[int]], max_tokens: int = 8, loras: list | None = None, **engine_args: Any
) -> list[list[int]]:
    """``run_greedy`` on a fresh engine."""
    return run_greedy(make_engine(plugins, **engine_args), prompts, max_tokens, loras)


def run_beam_search(engine, prompts: list[list[int]], width: int, max_tokens: int = 8, **params: Any) -> list[list]:
    """Beam-search hypotheses of ``prompts``, batched on ``engine``: per prompt, (token ids,
    cumulative logprob) best first."""
    from kiln.sampling_params import SamplingParams

    beam = SamplingParams(n=width, use_beam_search=True, max_tokens=max_tokens, **params)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, beam)
    done: dict[str, list] = {}
    for _ in range(100 * len(prompts) * (max_tokens + 1)):  # far more steps than any schedule needs
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            done[out.request_id] = [(o.token_ids, o.cumulative_logprob) for o in out.outputs]
    else:
        raise AssertionError("the beam searches did not finish: the scheduler is stuck")
    return [done[str(i)] for i in range(len(prompts))]
