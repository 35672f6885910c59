"""``--speculative-config`` (vLLM's JSON) and the separate flags seeds 001 and 003 use.

Only the methods Kiln runs are accepted; every other setting is refused with the reason,
never ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kiln.envs import env_flag

# vLLM's defaults when neither lookup bound is given.
DEFAULT_LOOKUP = 5
NGRAM_MODEL = ("[ngram]", "ngram")  # the older way to ask for n-gram lookup: --speculative-model "[ngram]"
_NOT_YET = (
    "speculative method {!r} is not implemented yet: Kiln speculates by n-gram prompt lookup "
    '(\'{{"method": "ngram", "num_speculative_tokens": 4}}\'), with a draft model '
    '(\'{{"method": "draft_model", "model": "PATH", "num_speculative_tokens": 4}}\') or an EAGLE head '
    '(\'{{"method": "eagle", "model": "PATH", "num_speculative_tokens": 4}}\', or "eagle3")'
)
MODEL_METHODS = ("draft_model", "eagle", "eagle3")  # the methods that load a second model


class SpeculativeConfig(BaseModel):
    """One engine's speculative decoding, as vLLM's ``speculative_config`` spells it.

    ``method`` ``ngram`` proposes, for each decoding sequence, the tokens that followed the
    most recent earlier occurrence of its last ``prompt_lookup_max`` .. ``prompt_lookup_min``
    tokens (in the prompt or its output). ``draft_model`` proposes the greedy continuation of
    a smaller ``model`` sharing the target's vocabulary (``kiln.worker.draft_model``);
    ``eagle`` and ``eagle3`` that of an EAGLE-1 or EAGLE-3 head ``model`` fed the target's
    hidden states (``kiln.worker.eagle``).
    Verification is exact (``rejection_sampler``): outputs are distributed as without
    speculation, token for token identical when greedy. Seed 001's environment switches:
    ``EAGLE_USE_SAFE_AI_LAB_STYLE`` (on: the only way Kiln runs EAGLE heads; 0 is refused) and
    ``ENABLE_SPEC_METRIC`` (0: no acceptance metrics or log line; see ``spec_metrics_enabled``).
    """

    model_config = ConfigDict(extra="forbid")

    method: str | None = Field(None, description="ngram, draft_model, eagle or eagle3")
    model: str | None = Field(None, description="a draft model, or '[ngram]' / 'ngram' (the older spelling)")
    num_speculative_tokens: int | None = Field(None, ge=1, le=64)
    prompt_lookup_max: int | None = Field(None, ge=1)
    prompt_lookup_min: int | None = Field(None, ge=1)
    draft_tensor_parallel_size: int | None = Field(None, ge=1)
    disable_by_batch_size: int | None = Field(None, ge=2)
    max_model_len: int | None = Field(None, ge=1)
    acceptance_method: Literal["rejection_sampler", "typical_acceptance_sampler"] = "rejection_sampler"
    posterior_threshold: float | None = None
    posterior_alpha: float | None = None
    quantization: str | None = None
    disable_mqa_scorer: bool = False
    disable_logprobs: bool | None = None

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        if self.method is None:
            if self.model is None:
                raise ValueError("give a method (ngram) or a draft model")
            self.method = "ngram" if self.model in NGRAM_MODEL else "draft_model"
        if self.method not in ("ngram", *MODEL_METHODS):
            raise ValueError(_NOT_YET.format(self.method))
        if self.num_speculative_tokens is None:
            raise ValueError("num_speculative_tokens is required (how many tokens to propose per step)")
        if self.method in MODEL_METHODS:
            return self._check_draft_model()
        if self.model is not None and self.model not in NGRAM_MODEL:
            raise ValueError(f"model: n-gram lookup uses no draft model (got {self.model!r})")
        if self.prompt_lookup_max is None:  # as vLLM: a bound not given equals the other one
            self.prompt_lookup_max = self.prompt_lookup_min or DEFAULT_LOOKUP
        if self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max ({self.prompt_lookup_max})"
            )
        refused = {
            "draft_tensor_parallel_size": (
                self.draft_tensor_parallel_size not in (None, 1),
                "n-gram lookup has no draft model to split over ranks",
            ),
            "quantization": (self.quantization is not None, "n-gram lookup has no draft model to quantize"),
            **self._exactness_refusals(),
        }
        _raise_first(refused)
        return self

    def _check_draft_model(self) -> SpeculativeConfig:
        eagle = self.method != "draft_model"
        refused = {
            "EAGLE_USE_SAFE_AI_LAB_STYLE": (  # seed 001's switch, on there by default
                eagle and not env_flag("EAGLE_USE_SAFE_AI_LAB_STYLE", True),
                "Kiln runs EAGLE heads only as their authors' code does (SafeAILab's, which the switch selects); "
                "unset it or set it to 1",
            ),
            "model": (self.model in (None, *NGRAM_MODEL), f"{self.method}: the draft's folder (or Hub id) is required"),
            "prompt_lookup_max": (self.prompt_lookup_max is not None, "n-gram lookup only"),
            "prompt_lookup_min": (self.prompt_lookup_min is not None, "n-gram lookup only"),
            "draft_tensor_parallel_size": (
                self.draft_tensor_parallel_size not in (None, 1),
                "the draft model runs whole on the first rank (seed 001 recommends 1: it is small)",
            ),
            "quantization": (
                self.quantization is not None,
                "the draft model's weights load as its checkpoint stores them; drop the setting",
            ),
            **self._exactness_refusals(),
        }
        _raise_first(refused)
        return self

    def _exactness_refusals(self) -> dict[str, tuple[bool, str]]:
        return {
            "acceptance_method": (
                self.acceptance_method != "rejection_sampler",
                "Kiln verifies drafts exactly (rejection_sampler); typical acceptance changes the output "
                "distribution and is not implemented",
            ),
            "posterior_threshold": (self.posterior_threshold is not None, "typical acceptance is not implemented"),
            "posterior_alpha": (self.posterior_alpha is not None, "typical acceptance is not implemented"),
            "disable_mqa_scorer": (
                self.disable_mqa_scorer,
                "Kiln scores drafts only in one multi-query pass over the paged cache (no batch-expansion scorer)",
            ),
            "disable_logprobs": (
                bool(self.disable_logprobs),
                "logprobs of emitted tokens are always returned, exact and at no extra cost; leave it unset or false",
            ),
        }


def _raise_first(refused: dict[str, tuple[bool, str]]) -> None:
    for name, (bad, why) in refused.items():
        if bad:
            raise ValueError(f"{name}: {why}")


class SpeculativeFlags(BaseModel):
    """The separate speculative flags of seeds 001 and 003, folded into ``speculative_config``
    (a base of ``EngineConfig``: one ``--flag`` each). They are frozen: given at construction
    only, since an assignment would bypass the folding."""

    speculative_config: SpeculativeConfig | None = Field(
        None, description='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\''
    )
    speculative_model: str | None = Field(
        frozen=True, default=None, description="a draft model's folder, or '[ngram]' for prompt lookup"
    )
    num_speculative_tokens: int | None = Field(
        frozen=True, default=None, description="tokens proposed per step (with --speculative-model)"
    )
    speculative_draft_tensor_parallel_size: int | None = Field(
        frozen=True, default=None, description="draft model ranks (ngram: 1)"
    )
    speculative_max_model_len: int | None = Field(
        frozen=True, default=None, description="sequences longer than this do not speculate"
    )
    speculative_disable_by_batch_size: int | None = Field(
        frozen=True, default=None, description="no drafts while more requests than this are running or waiting"
    )
    ngram_prompt_lookup_max: int | None = Field(frozen=True, default=None, description="the longest n-gram looked up")
    ngram_prompt_lookup_min: int | None = Field(frozen=True, default=None, description="the shortest n-gram looked up")
    speculative_model_quantization: str | None = Field(
        frozen=True, default=None, description="draft model quantization (refused)"
    )
    speculative_disable_mqa_scorer: bool = Field(
        frozen=True, default=False, description="refused: drafts are scored in one pass"
    )
    spec_decoding_acceptance_method: Literal["rejection_sampler", "typical_acceptance_sampler"] | None = Field(
        frozen=True, default=None, description="rejection_sampler (exact); typical acceptance is refused"
    )
    typical_acceptance_sampler_posterior_threshold: float | None = Field(
        frozen=True, default=None, description="refused"
    )
    typical_acceptance_sampler_posterior_alpha: float | None = Field(frozen=True, default=None, description="refused")
    disable_logprobs_during_spec_decoding: bool | None = Field(
        frozen=True, default=None, description="refused when true: logprobs are exact and free with speculation"
    )

    @model_validator(mode="before")
    @classmethod
    def _fold_flags(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        given = {old: data[old] for old in LEGACY_FLAGS if data.get(old) is not None and data.get(old) is not False}
        if not given:
            return data
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        if data.get("speculative_config") is not None:
            raise ValueError(f"give --speculative-config or the separate flags ({flags}), not both")
        if "speculative_model" not in given:
            raise ValueError(f"{flags} need --speculative-model (a draft model, or [ngram] for prompt lookup)")
        # The flags live on only inside speculative_config (so a later assignment re-folds nothing).
        data = {key: value for key, value in data.items() if key not in given}
        data["speculative_config"] = {LEGACY_FLAGS[old]: value for old, value in given.items()}
        return data


# The separate flags and the ``speculative_config`` keys they set.
LEGACY_FLAGS = {
    "speculative_model": "model",
    "num_speculative_tokens": "num_speculative_tokens",
    "speculative_draft_tensor_parallel_size": "draft_tensor_parallel_size",
    "speculative_max_model_len": "max_model_len",
    "speculative_disable_by_batch_size": "disable_by_batch_size",
    "ngram_prompt_lookup_max": "prompt_lookup_max",
    "ngram_prompt_lookup_min": "prompt_lookup_min",
    "speculative_model_quantization": "quantization",
    "speculative_disable_mqa_scorer": "disable_mqa_scorer",
    "spec_decoding_acceptance_method": "acceptance_method",
    "typical_acceptance_sampler_posterior_threshold": "posterior_threshold",
    "typical_acceptance_sampler_posterior_alpha": "posterior_alpha",
    "disable_logprobs_during_spec_decoding": "disable_logprobs",
}


def spec_metrics_enabled() -> bool:
    """``ENABLE_SPEC_METRIC`` (seed 001): 0 leaves the drafted and accepted counts out of
    ``/metrics`` and the stats log line; unset, they are reported, as vLLM reports them."""
    return env_flag("ENABLE_SPEC_METRIC", True)
