"""The sampling layer: logits -> tokens.

This face re-exports `SamplingParams`, the one name a user of the package needs from here
(`from nanoserve.sampling import SamplingParams`). It imports no torch, so neither does the
scheduler, which keeps a `SamplingParams` on every sequence.
"""

from nanoserve.sampling.params import SamplingParams

__all__ = ["SamplingParams"]
