"""Issue 38: sessions. A conversation's KV stays in the engine between its HTTP turns.

A chat client sends the whole conversation every turn. With a session id (the body's `session_id`,
or the `X-Session-Id` header) the server runs each turn with `hold_kv=True` and `resume_from=` the
request id of the session's previous turn (`Engine.add_request`, nanoserve/scheduler/held.py): the
next turn's prompt, rendered by the chat template again, starts with everything before it, so only
the new part is prefilled. Between turns the blocks are held, not cached: the prefix cache's LRU
never takes them, only these do:

    the TTL          a session idle for `ttl` seconds is released (its next turn re-prefills)
    the cap          the blocks held on one model's engine stay under `kv_fraction` of its pool:
                     past it, the sessions idle longest are released first
    the engine       when a step needs blocks and none are free, the engine evicts held KV (the
                     oldest first) before it preempts anyone

A turn that could not resume is counted with why (`nanoserve:session_turns_total{outcome, reason}`):
new (the first turn), expired, evicted (the cap or the engine took it), mismatch (the prompt does not
start like the previous turn's), aborted (the previous turn failed or was cancelled), unloaded (its
model was unloaded meanwhile). One turn of a session runs at a time: a second one meanwhile is a 409.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nanoserve.engine.async_engine import AsyncEngine
from nanoserve.engine.outputs import RequestOutput
from nanoserve.server.models import ModelRegistry
from nanoserve.server.protocol import APIError

SESSION_HEADER = "x-session-id"
MAX_SESSION_ID = 128  # characters
DEFAULT_TTL = 600.0  # seconds
DEFAULT_KV_FRACTION = 0.5  # of each model's KV pool


def session_id_of(body: dict, headers) -> str | None:
    """The request's session id (the body's `session_id`, else the `X-Session-Id` header), or None.
    400 for one that is not a non-empty string of at most MAX_SESSION_ID characters, or when the two
    differ."""
    in_body, in_header = body.get("session_id"), headers.get(SESSION_HEADER)
    if in_body is not None and (not isinstance(in_body, str) or not 0 < len(in_body) <= MAX_SESSION_ID):
        raise APIError(400, f"'session_id' must be a string of 1 to {MAX_SESSION_ID} characters", param="session_id")
    if in_header is not None and not 0 < len(in_header) <= MAX_SESSION_ID:
        raise APIError(400, f"the X-Session-Id header must hold 1 to {MAX_SESSION_ID} characters", param="session_id")
    if in_body is not None and in_header is not None and in_body != in_header:
        raise APIError(400, "the body's 'session_id' and the X-Session-Id header name different sessions: send one, "
                            "or the same in both", param="session_id")
    return in_body if in_body is not None else in_header


@dataclass
class Session:
    """One conversation on one model: the request id its KV is held under (None: nothing held, and
    `lost` says why), the blocks that held, when it was last used, and whether a turn runs now."""

    engine: AsyncEngine
    last_use: float
    held_id: int | None = None
    blocks: int = 0
    busy: bool = False
    lost: str = "new"


class SessionTurn:
    """One turn of a session: the options its request runs with (`options`), and its end (`end`,
    called once, by `track` or by the handler when the turn failed before it began)."""

    def __init__(self, store: "SessionStore", session: Session, resume_from: int | None):
        self.store, self.session, self.resume_from = store, session, resume_from
        self.ended = False

    def options(self) -> dict:
        """For `AsyncEngine.generate`: hold this turn's KV, and start from the previous turn's."""
        return dict(hold_kv=True, resume_from=self.resume_from)

    async def track(self, outputs):
        """`outputs` (an `AsyncEngine.generate`), passed through; the turn ends with its last output."""
        last = None
        try:
            async for out in outputs:
                last = out
                yield out
        finally:
            await outputs.aclose()
            self.end(last if last is not None and last.finished else None)

    def end(self, last: RequestOutput | None) -> None:
        """The turn is over: `last` is its final output, or None when it failed or was cancelled."""
        if self.ended:
            return
        self.ended = True
        self.store.turn_ended(self, last)


class SessionStore:
    """The sessions of a server, by (model, session id). `ttl` seconds idle and a session is released;
    the sessions of one engine hold at most `kv_fraction` of its KV blocks. `clock`: seconds (tests
    pass a fake one)."""

    def __init__(self, models: ModelRegistry, ttl: float = DEFAULT_TTL, kv_fraction: float = DEFAULT_KV_FRACTION,
                 clock=time.monotonic):
        if ttl <= 0 or not 0 <= kv_fraction <= 1:
            raise ValueError(f"a session TTL must be > 0 seconds (got {ttl}) and its share of the KV pool in "
                             f"[0, 1] (got {kv_fraction})")
        self.models, self.ttl, self.kv_fraction, self.clock = models, ttl, kv_fraction, clock
        self.sessions: dict[tuple[str, str], Session] = {}
        self.turns: Counter = Counter()  # (outcome, reason) -> turns
        self.released: Counter = Counter()  # reason (expired, cap) -> sessions whose KV the server released
        self._tasks: set = set()  # releases under way (kept referenced until done)

    async def begin(self, model: str, engine: AsyncEngine, session_id: str) -> SessionTurn:
        """Start a turn of `session_id` on `model`: 409 while another turn of it runs."""
        await self.expire()
        session = self.sessions.get((model, session_id))
        if session is not None and session.engine is not engine:  # the model was unloaded (and maybe loaded again)
            session.engine, session.held_id, session.blocks, session.lost = engine, None, 0, "unloaded"
        if session is None:
            session = self.sessions[(model, session_id)] = Session(engine, self.clock())
        if session.busy:
            raise APIError(409, f"session '{session_id}' has a turn in flight: send the next turn once it has "
                                "finished", param="session_id", code="session_busy")
        session.busy, session.last_use = True, self.clock()
        resume_from, session.held_id, session.blocks = session.held_id, None, 0
        return SessionTurn(self, session, resume_from)

    def turn_ended(self, turn: SessionTurn, last: RequestOutput | None) -> None:
        """A turn is over (`last`: its final output, None when it failed or was cancelled): count how it
        began, keep its KV for the next turn, and bring the blocks its engine holds for sessions under
        the cap, releasing the sessions idle longest first."""
        # >>> week25: end-of-turn
        session = turn.session
        session.busy, session.last_use = False, self.clock()
        if last is None or last.finish_reason not in ("stop", "length"):
            session.lost = "aborted"
            if turn.resume_from is not None:  # in case the request never reached the engine
                self._release(session.engine, turn.resume_from)
            return
        if turn.resume_from is None:
            self.turns["reprefilled", session.lost] += 1
        elif last.resume_outcome == "resumed":
            self.turns["resumed", ""] += 1
        else:
            self.turns["reprefilled", last.resume_outcome or "evicted"] += 1
        session.held_id, session.blocks = (last.request_id, last.num_held_blocks) if last.num_held_blocks else (None, 0)
        session.lost = "evicted"  # why its next turn would not resume, if its KV goes
        engine = session.engine
        limit = self.kv_fraction * engine.kv_blocks()[1]
        held = engine.held_kv()["blocks"]
        idle = sorted((s for s in self.sessions.values() if s.engine is engine and s.held_id is not None and not s.busy),
                      key=lambda s: s.last_use)
        for other in idle:
            if held <= limit:
                return
            held -= other.blocks
            self._drop(other, "evicted", "cap")
        # <<< week25: end-of-turn

    async def expire(self) -> None:
        """Release the sessions idle for the TTL; forget those idle for twice that (their next turn is new)."""
        now = self.clock()
        for key, session in list(self.sessions.items()):
            if session.busy or now - session.last_use < self.ttl:
                continue
            if session.held_id is not None:
                self._drop(session, "expired", "expired")
            elif now - session.last_use >= 2 * self.ttl:
                del self.sessions[key]

    def _drop(self, session: Session, lost: str, why: str) -> None:
        self._release(session.engine, session.held_id)
        session.held_id, session.blocks, session.lost = None, 0, lost
        self.released[why] += 1

    def _release(self, engine: AsyncEngine, held_id: int) -> None:
        """`AsyncEngine.release_held`, on the engine thread, not awaited (its commands run in order)."""
        try:
            task = asyncio.get_running_loop().create_task(engine.release_held(held_id))
        except RuntimeError:  # no loop (a generator closed by the garbage collector): the engine's eviction frees it
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        """The server stops: forget every session (their KV goes with the engines)."""
        self.sessions.clear()

    def collect(self):
        """Prometheus families (a collector of `ServerMetrics`'s registry): turns by outcome and reason,
        sessions known, and the KV blocks held on the loaded models' engines."""
        turns = CounterMetricFamily("nanoserve:session_turns", "Session turns, by outcome (resumed: the previous "
                                    "turn's KV reused; reprefilled) and why it was reprefilled (new, expired, "
                                    "evicted, mismatch, aborted, unloaded)", labels=["outcome", "reason"])
        for (outcome, reason), count in sorted(self.turns.items()):
            turns.add_metric([outcome, reason], count)
        yield turns
        released = CounterMetricFamily("nanoserve:session_releases", "Sessions whose KV the server released, by "
                                       "why (expired: idle past --session-ttl; cap: over --session-kv-fraction)",
                                       labels=["reason"])
        for why, count in sorted(self.released.items()):
            released.add_metric([why], count)
        yield released
        yield GaugeMetricFamily("nanoserve:sessions", "Sessions the server knows", value=len(self.sessions))
        pinned = sum(m.engine.held_kv()["blocks"] for m in self.models.loaded())
        yield GaugeMetricFamily("nanoserve:session_pinned_blocks", "KV blocks held between turns (sessions), over "
                                "the loaded models", value=pinned)
