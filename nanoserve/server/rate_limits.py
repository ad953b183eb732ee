"""Issue 38: rate limits per API key, as token buckets (`--rate-limit-rpm`, `--rate-limit-tpm`).

A bucket holds up to a minute's allowance (`capacity`) and refills continuously at capacity / 60
units a second. A request takes one unit from its client's request bucket when it arrives, and
its tokens from the token bucket once its prompt is tokenized: the prompt's tokens plus what it
may generate (max_tokens for each choice), as OpenAI counts a request against its limits before
it runs. What the request does not use is not given back. A bucket without enough answers 429
with `Retry-After`: the whole seconds until it will have enough (burst up to a minute's allowance,
then a steady rate).

The client is its API key (`--api-key`, which may be given several times: each key gets its own
buckets); a server without keys limits each client address instead. A request that asks for more
tokens than a whole minute allows could never pass: that is a 400, not a 429 to retry forever.

The clock is a parameter, so that the tests drive time by hand.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from nanoserve.server.protocol import APIError

PRUNE_EVERY = 1024  # takes between two sweeps of the buckets that have filled up again


@dataclass
class TokenBucket:
    """`level` units out of `capacity`, refilled at `rate` units a second since `stamp`."""

    capacity: float
    rate: float
    level: float
    stamp: float

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def take(self, cost: float, now: float) -> float:
        """Take `cost` units and return 0, or take nothing and return the seconds until `cost` fits."""
        # >>> week25: token-bucket
        self.refill(now)
        if cost <= self.level:
            self.level -= cost
            return 0.0
        return (cost - self.level) / self.rate
        # <<< week25: token-bucket

    def full(self, now: float) -> bool:
        self.refill(now)
        return self.level >= self.capacity


class RateLimiter:
    """Request and token buckets per client. `requests_per_minute`, `tokens_per_minute`: the
    limits (None: that one is off)."""

    def __init__(self, requests_per_minute: int | None = None, tokens_per_minute: int | None = None,
                 clock: Callable[[], float] = time.monotonic):
        for flag, limit in (("--rate-limit-rpm", requests_per_minute), ("--rate-limit-tpm", tokens_per_minute)):
            if limit is not None and limit < 1:
                raise ValueError(f"{flag} must be at least 1, got {limit}")
        self.limits = {"requests": requests_per_minute, "tokens": tokens_per_minute}
        self.clock = clock
        self.buckets: dict[tuple[str, str], TokenBucket] = {}
        self.refused: Counter = Counter()  # 429s, by limit ("requests", "tokens"): for /metrics
        self.takes = 0

    def take_request(self, client: str) -> None:
        """One request of `client`'s, or a 429."""
        self.take("requests", client, 1)

    def take_tokens(self, client: str, tokens: int) -> None:
        """`tokens` of `client`'s, or a 429 (a 400 for more than a minute's allowance)."""
        limit = self.limits["tokens"]
        if limit is not None and tokens > limit:
            raise APIError(400, f"this request counts {tokens} tokens (its prompt, and max_tokens for each choice), more "
                                f"than this server allows a client in a minute ({limit}, --rate-limit-tpm): send a "
                                "shorter prompt or a smaller 'max_tokens'", param="max_tokens", code="rate_limit_exceeded")
        self.take("tokens", client, tokens)

    def take(self, kind: str, client: str, cost: int) -> None:
        limit = self.limits[kind]
        if limit is None:
            return
        now = self.clock()
        bucket = self.buckets.get((kind, client))
        if bucket is None:
            bucket = self.buckets[kind, client] = TokenBucket(limit, limit / 60, limit, now)
        wait = bucket.take(cost, now)
        self.prune(now)
        if wait > 0:
            self.refused[kind] += 1
            seconds = max(1, math.ceil(wait))
            raise APIError(429, f"rate limit reached: {limit} {kind} per minute for this client; retry in {seconds} s",
                           type_=kind, code="rate_limit_exceeded", headers={"Retry-After": str(seconds)})

    def prune(self, now: float) -> None:
        """Drop the buckets that have filled up again (a full bucket is a new one): the table stays
        as large as the clients of the last minute, however many came before."""
        self.takes += 1
        if self.takes % PRUNE_EVERY == 0:
            self.buckets = {key: b for key, b in self.buckets.items() if not b.full(now)}
