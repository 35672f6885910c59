"""Per-request sampling parameters (vLLM's names and defaults)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from enum import Enum
from numbers import Integral, Real

from kiln.interfaces.guided import GuidedDecodingParams

# Integer fields end up in int64 tensors and torch generators: anything wider would crash a step.
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_INTS = ("n", "best_of", "top_k", "min_tokens")
_OPTIONAL_INTS = ("seed", "max_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens")
_FLOATS = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "min_p",
    "length_penalty",
)
_BOOLS = (
    "include_stop_str_in_output",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "use_beam_search",
)
_LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a bias
MAX_STRINGS = 1024  # stop strings and bad words per request
# What reshapes the sampling distribution: beam search refuses these in a request, and a
# server drops them from the model's generation defaults for beam-search requests.
SAMPLING_SHAPERS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "top_p", "top_k", "min_p")


class RequestOutputKind(Enum):
    CUMULATIVE = 0  # every output carries the whole text so far
    DELTA = 1  # every output carries only what is new
    FINAL_ONLY = 2  # one output when the request finishes


@dataclass(slots=True)
class SamplingParams:
    """What to sample and when to stop. Invalid values raise ``ValueError`` naming the field."""

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    # Beam search (``kiln.engine.beam_search``): ``best_of`` beams, the best ``n`` returned.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never", as transformers
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY
    # Filled by the engine from the tokenizer (bad_words) and guided decoding.
    guided_decoding: GuidedDecodingParams | None = None
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    # Special tokens kept in the text under skip_special_tokens: a tool or reasoning parser's
    # markup (set by the server, see kiln.engine.tokenizer.markup_token_ids).
    _kept_special_ids: frozenset[int] = field(default_factory=frozenset, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _list_of("stop", self.stop or [], str)
        self.stop_token_ids = _list_of("stop_token_ids", self.stop_token_ids or [], Integral)
        if self.bad_words is not None:
            self.bad_words = _list_of("bad_words", self.bad_words, str)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _list_of("allowed_token_ids", self.allowed_token_ids, Integral)
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        if self.best_of is None:
            self.best_of = self.n
        self._check_types()
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _check_types(self) -> None:
        """Types and finiteness, for callers that bypass a typed front end (``/generate``, overrides)."""
        for name in _INTS + _OPTIONAL_INTS:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL_INTS:
                continue
            if isinstance(value, bool) or not isinstance(value, Integral):
                raise ValueError(f"{name} must be an integer, got {_shown(value)}.")
            if not _INT64_MIN <= value <= _INT64_MAX:
                raise ValueError(f"{name} must fit in 64 bits, got {_shown(value)}.")
            setattr(self, name, int(value))
        for name in _FLOATS:
            setattr(self, name, _finite(name, getattr(self, name)))
        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {_shown(getattr(self, name))}.")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {_shown(self.output_kind)}.")
        if self.guided_decoding is not None and not isinstance(self.guided_decoding, GuidedDecodingParams):
            raise ValueError(f"guided_decoding must be a GuidedDecodingParams, got {_shown(self.guided_decoding)}.")

    def _validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name} {why}")

        for name in ("stop", "bad_words"):
            if len(getattr(self, name) or ()) > MAX_STRINGS:
                bad(name, f"holds at most {MAX_STRINGS} strings (each is checked at every generated token).")
        if self.n < 1:
            bad("n", f"must be at least 1, got {self.n}.")
        if self.best_of < self.n:
            bad("best_of", f"must be greater than or equal to n, got n={self.n} and best_of={self.best_of}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}.")
        if self.repetition_penalty <= 0.0:
            bad("repetition_penalty", f"must be greater than zero, got {self.repetition_penalty}.")
        if self.temperature < 0.0:
            bad("temperature", f"must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            bad("top_k", f"must be -1 (disable) or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            bad("min_tokens", f"must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.")
        if self.logprobs is not None and self.logprobs < 0:
            bad("logprobs", f"must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            bad("prompt_logprobs", f"must be non-negative, got {self.prompt_logprobs}.")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            bad("truncate_prompt_tokens", f"must be at least 1, got {self.truncate_prompt_tokens}.")
        if any(s == "" for s in self.stop):
            bad("stop", "cannot contain an empty string.")
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) == 0:
            bad("allowed_token_ids", "must not be empty.")
        if self.early_stopping not in (True, False, "never"):
            bad("early_stopping", f"must be true, false or 'never', got {_shown(self.early_stopping)}.")
        if self.use_beam_search:
            self._validate_beam_search()
        else:
            for name, default in (("length_penalty", 1.0), ("early_stopping", False)):
                if getattr(self, name) != default:
                    bad(name, "applies to beam search only: set use_beam_search.")

    def _validate_beam_search(self) -> None:
        """Beams are ranked by the model's own log-probabilities (as transformers' beam search
        without sampling), so parameters that reshape or constrain sampling are refused, not
        ignored; ``temperature`` and ``seed`` play no part."""
        defaults = SamplingParams.__dataclass_fields__
        refused = {
            "stop": bool(self.stop),
            "bad_words": bool(self.bad_words),
            "logit_bias": bool(self.logit_bias),
            "allowed_token_ids": self.allowed_token_ids is not None,
            "logprobs": self.logprobs is not None,
            **{name: getattr(self, name) != defaults[name].default for name in SAMPLING_SHAPERS},
        }
        for name, given in refused.items():
            if given:
                raise ValueError(
                    f"{name} is not supported with beam search (use_beam_search); each beam's "
                    "cumulative_logprob is returned instead of per-token logprobs."
                    if name == "logprobs"
                    else f"{name} is not supported with beam search (use_beam_search)."
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


@dataclass(slots=True)
class BeamSearchParams:
    """``LLM.beam_search``'s parameters (vLLM's names). ``beam_width`` beams are kept and all of
    them returned, best first; ``temperature`` is accepted for vLLM's signature and plays no
    part (beams are ranked by the model's log-probabilities). ``early_stopping`` is
    transformers' (True, False or "never")."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def to_sampling_params(self) -> SamplingParams:
        return SamplingParams(
            n=self.beam_width,
            use_beam_search=True,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            length_penalty=self.length_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output,
            early_stopping=self.early_stopping,
        )


REQUEST_FIELDS = frozenset(f.name for f in fields(SamplingParams) if not f.name.startswith("_")) - {"output_kind"}
"""The fields a caller may set (``/generate``'s body, ``--override-generation-config``)."""


def _shown(value: object) -> str:
    """A bad value for an error message: short, and printable whatever the client sent."""
    try:
        text = repr(value)
    except ValueError:  # an integer past Python's digit limit for str()
        return "an integer too large to print"
    return text if len(text) <= 80 else text[:77] + "..."


def _finite(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a number, got {_shown(value)}.")
    try:
        number = float(value)
    except OverflowError:  # an integer past float range
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {_shown(value)}.")
    return number


def _list_of(name: str, value: object, kind: type) -> list:
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{name} must be a list, got {_shown(value)}.")
    items = list(value)
    for item in items:
        if isinstance(item, bool) or not isinstance(item, kind):
            raise ValueError(f"{name} must hold only {'strings' if kind is str else 'integers'}, got {_shown(item)}.")
    return items


def _logit_bias(value: object) -> dict[int, float]:
    """Token id (an int, or its decimal text as JSON keys are) to a finite bias in [-100, 100]."""
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must map token ids to biases, got {_shown(value)}.")
    out = {}
    for key, bias in value.items():
        try:
            token = int(key) if not isinstance(key, (bool, float)) else None
        except ValueError:
            token = None
        if token is None:
            raise ValueError(f"logit_bias keys must be token ids, got {_shown(key)}.")
        bias = _finite("logit_bias", bias)
        if not -_LOGIT_BIAS_LIMIT <= bias <= _LOGIT_BIAS_LIMIT:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {token}.")
        out[token] = bias
    return out
