"""Issue 38: rate limits per API key, token buckets on requests and on tokens, driven by a fake clock;
over HTTP, a 429 in OpenAI's error shape with Retry-After, which the official client reads."""

import httpx
import openai
import pytest

from nanoserve.server.protocol import APIError
from nanoserve.server.rate_limits import PRUNE_EVERY, RateLimiter, TokenBucket
from nanoserve.testing import ServerThread


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def refused(take, *args) -> APIError:
    with pytest.raises(APIError) as e:
        take(*args)
    return e.value


@pytest.mark.exercise("token-bucket")
def test_a_bucket_bursts_then_refills_at_its_rate():
    bucket = TokenBucket(capacity=6, rate=0.1, level=6, stamp=0.0)
    assert [bucket.take(2, 0.0) for _ in range(3)] == [0, 0, 0]
    assert bucket.take(1, 0.0) == pytest.approx(10.0)  # empty: one unit comes in 10 s
    assert bucket.take(1, 10.0) == 0
    assert bucket.take(6, 10.0) == pytest.approx(60.0)  # refused whole: nothing taken
    assert bucket.full(70.0) and bucket.level == 6  # never over capacity


@pytest.mark.exercise("token-bucket")
def test_requests_per_minute_each_key_its_own_bucket():
    clock = FakeClock()
    limits = RateLimiter(requests_per_minute=3, clock=clock)
    for _ in range(3):
        limits.take_request("alice")
    e = refused(limits.take_request, "alice")
    assert (e.status, e.code, e.type, e.headers) == (429, "rate_limit_exceeded", "requests", {"Retry-After": "20"})
    limits.take_request("bob")  # another key: a full bucket of its own
    clock.now += 19.9
    assert refused(limits.take_request, "alice").headers == {"Retry-After": "1"}  # whole seconds, at least 1
    clock.now += 0.1
    limits.take_request("alice")  # 20 s: one more request (3 a minute)
    assert limits.refused == {"requests": 2}


@pytest.mark.exercise("token-bucket")
def test_tokens_per_minute_and_a_request_that_could_never_pass():
    clock = FakeClock()
    limits = RateLimiter(tokens_per_minute=600, clock=clock)
    limits.take_tokens("alice", 500)
    e = refused(limits.take_tokens, "alice", 200)  # 100 left: 100 more come in 10 s
    assert (e.status, e.type, e.headers["Retry-After"]) == (429, "tokens", "10")
    clock.now += 10
    limits.take_tokens("alice", 200)
    too_big = refused(limits.take_tokens, "bob", 601)  # more than a minute's allowance: retrying cannot help
    assert too_big.status == 400 and "--rate-limit-tpm" in too_big.message
    limits.take_request("alice")  # no request limit set: nothing to take
    with pytest.raises(ValueError, match="--rate-limit-rpm must be at least 1"):
        RateLimiter(requests_per_minute=0)


@pytest.mark.exercise("token-bucket")
def test_the_buckets_of_clients_gone_quiet_are_dropped():
    clock = FakeClock()
    limits = RateLimiter(requests_per_minute=60, clock=clock)
    for i in range(PRUNE_EVERY - 1):
        limits.take_request(f"client-{i}")
    assert len(limits.buckets) == PRUNE_EVERY - 1
    clock.now += 2  # every bucket has refilled its one request
    limits.take_request("late")  # the sweep runs on this take
    assert len(limits.buckets) <= 1


@pytest.mark.exercise("token-bucket")
def test_over_http_a_429_with_retry_after_per_api_key():
    clock = FakeClock()
    limits = RateLimiter(requests_per_minute=2, tokens_per_minute=100, clock=clock)
    with ServerThread(engine_kwargs=dict(max_model_len=256, num_blocks=64), api_key=["k1", "k2"],
                      app_kwargs={"rate_limits": limits}) as s:
        def complete(key, max_tokens=2):
            return httpx.post(s.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                              json={"model": "tiny", "prompt": "The list", "max_tokens": max_tokens})

        assert [complete("k1").status_code for _ in range(2)] == [200, 200]
        over = complete("k1")
        assert over.status_code == 429 and over.headers["retry-after"] == "30"
        assert set(over.json()["error"]) == {"message", "type", "param", "code"}
        assert over.json()["error"]["code"] == "rate_limit_exceeded"
        assert complete("k2").status_code == 200  # the other key's own buckets
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="k1", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="tiny", prompt="The list", max_tokens=2)
        clock.now += 30
        assert complete("k1").status_code == 200
        # tokens: the prompt's and max_tokens count, 100 a minute
        clock.now += 60  # every bucket full again
        assert complete("k2", max_tokens=60).status_code == 200
        assert complete("k2", max_tokens=60).status_code == 429
        clock.now += 30
        assert complete("k2", max_tokens=150).status_code == 400  # never within a minute's 100
        metrics = httpx.get(s.url + "/metrics").text
        assert 'nanoserve:rate_limited_requests_total{limit="requests"} 2.0' in metrics
        assert 'nanoserve:rate_limited_requests_total{limit="tokens"} 1.0' in metrics


@pytest.mark.exercise("token-bucket")
def test_without_api_keys_each_client_address_is_limited():
    clock = FakeClock()
    with ServerThread(engine_kwargs=dict(max_model_len=256, num_blocks=64),
                      app_kwargs={"rate_limits": RateLimiter(requests_per_minute=1, clock=clock)}) as s:
        body = {"model": "tiny", "prompt": "The list", "max_tokens": 2}
        assert httpx.post(s.url + "/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, "messages": [
            {"role": "user", "content": "hi"}]}).status_code == 200
        assert httpx.post(s.url + "/v1/completions", json=body).status_code == 429  # the same address, 127.0.0.1


def test_the_command_line_flags():
    from nanoserve.cli import build_parser

    args = build_parser().parse_args(["serve", "--rate-limit-rpm", "60", "--rate-limit-tpm", "1000",
                                      "--api-key", "a", "--api-key", "b"])
    assert (args.rate_limit_rpm, args.rate_limit_tpm, args.api_key) == (60, 1000, ["a", "b"])
    off = build_parser().parse_args(["serve"])
    assert (off.rate_limit_rpm, off.rate_limit_tpm, off.api_key) == (None, None, None)
