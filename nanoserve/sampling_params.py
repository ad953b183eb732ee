"""Week 3: a request's sampling settings, validated.

`SamplingParams` is plain data, kept apart from the sampler's tensors (`nanoserve/sampling.py`)
so that the scheduler, which stores it on every sequence, needs no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field


SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
