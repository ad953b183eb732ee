"""Week 3: a request's sampling settings, validated.

`SamplingParams` is plain data, kept apart from the sampler's tensors (`nanoserve/sampling/sampler.py`)
so that the scheduler, which stores it on every sequence, needs no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
MAX_LOGPROBS = 20  # the most alternatives per position a request may ask for (OpenAI's limit)
# Where the sampler's float32 arithmetic stays sound, with a wide margin: it divides the logits by the
# temperature and by (or multiplies them by) the repetition penalty, and compares top_p with a float32 sum.
# At temperature 1e-38 or a penalty of 1e-40 the logits overflow to inf; a top_p of 5e-324 rounds to 0 and
# keeps no token at all. (0 stays the temperature of greedy decoding; a top_p below 1 / vocabulary size
# already keeps only the most likely token.)
MIN_TEMPERATURE = 1e-3
MIN_TOP_P = 1e-8
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-2, 1e2
MAX_TOP_K = 2**31 - 1  # the sampler holds top_k in an int64 tensor; any k >= the vocabulary size is "off"


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off; else keep the k most likely tokens
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the prompt or output
    max_tokens: int = 16  # new tokens at most
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the output)
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop tokens (besides EOS)
    ignore_eos: bool = False  # keep going past EOS (benchmarks want fixed output lengths)
    seed: int | None = None  # a private generator for this request: reproducible draws
    # The wider OpenAI surface (week 10; see nanoserve/sampling/sampler.py for the order they apply in):
    presence_penalty: float = 0.0  # subtracted from every token already generated (output only)
    frequency_penalty: float = 0.0  # subtracted once per time a token was already generated
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    logprobs: int | None = None  # report each output token's logprob and this many alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token (the first has none)
    grammar: str | None = None  # structured output: an llguidance grammar (nanoserve/sampling/grammar.py)

    def __post_init__(self) -> None:
        # >>> week03: validate-params
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        checks = [
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be an integer >= 0 (0 = off), got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, f"max_tokens must be an integer >= 1, got {self.max_tokens}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            (self.seed is None or isinstance(self.seed, int) and SEED_MIN <= self.seed <= SEED_MAX,
             f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        # <<< week03: validate-params
        self._check_arithmetic()
        self._check_openai_fields()

    def _check_arithmetic(self) -> None:
        """Values the checks above let through but float32 sampling cannot compute with (see MIN_TEMPERATURE)."""
        checks = [
            (self.top_k <= MAX_TOP_K, f"top_k must be at most {MAX_TOP_K}, got {self.top_k}"),
            (not 0 < self.temperature < MIN_TEMPERATURE,
             f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {self.temperature}"),
            (not 0 < self.top_p < MIN_TOP_P, f"top_p must be at least {MIN_TOP_P:g}, got {self.top_p}"),
            (not (0 < self.repetition_penalty < MIN_REPETITION_PENALTY or self.repetition_penalty > MAX_REPETITION_PENALTY),
             f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}], got "
             + str(self.repetition_penalty)),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def _check_openai_fields(self) -> None:
        """The wider OpenAI surface's fields. (The server checks OpenAI's ranges, [-2, 2] and [-100, 100]; the
        engine only refuses what it cannot compute with.)"""
        self.logit_bias = dict(self.logit_bias)
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        for token, bias in self.logit_bias.items():
            if not (isinstance(token, int) and token >= 0 and math.isfinite(bias)):
                raise ValueError(f"logit_bias maps token ids (integers >= 0) to finite numbers, "
                                 f"got {token!r}: {bias!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not (isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {k!r}")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError(f"grammar must be None or a string (nanoserve.sampling.grammar.grammar_for), got {self.grammar!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
