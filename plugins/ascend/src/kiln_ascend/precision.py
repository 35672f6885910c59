"""The high-precision switches of the Ascend deployment guide (seed 001), mapped to op arguments
in one place. Environment variables win over platform defaults, as in the guide:

* ``USE_PFA_HIGH_PRECISION_MODE`` (default 1): prefill attention in high precision.
* ``USE_IFA_HIGH_PRECISION_MODE`` (default 0): decode attention in high precision.
* ``USE_PREFIX_HIGH_PRECISION_MODE`` (default 0): prefills on a cached prefix in high precision.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# inner_precise of torch_npu's attention ops: 0 = high precision, 1 = high performance;
# +2 also corrects rows whose keys are all masked.
HIGH_PRECISION, HIGH_PERFORMANCE = 0, 1


def _flag(name: str, default: bool) -> bool:
    return os.environ.get(name, "1" if default else "0").strip() not in ("0", "", "false", "False")


@dataclass(frozen=True)
class PrecisionModes:
    pfa_high_precision: bool = True
    ifa_high_precision: bool = False
    prefix_high_precision: bool = False

    @classmethod
    def from_env(cls) -> PrecisionModes:
        return cls(
            _flag("USE_PFA_HIGH_PRECISION_MODE", True),
            _flag("USE_IFA_HIGH_PRECISION_MODE", False),
            _flag("USE_PREFIX_HIGH_PRECISION_MODE", False),
        )

    def prefill(self, on_cached_prefix: bool) -> int:
        high = self.prefix_high_precision if on_cached_prefix else self.pfa_high_precision
        return HIGH_PRECISION if high else HIGH_PERFORMANCE

    def decode(self) -> int:
        return HIGH_PRECISION if self.ifa_high_precision else HIGH_PERFORMANCE
