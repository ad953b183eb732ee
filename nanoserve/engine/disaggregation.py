"""Issue 35: an engine's side of disaggregated prefill and decode.

Prefill is compute-bound (thousands of tokens per forward pass), decode memory-bound (one token
per sequence per pass, the weights and the KV read each time); one GPU doing both makes every
decode stream stall behind every long prompt. Disaggregated serving gives each phase its own
engine. A request goes (nanoserve/server/disaggregated.py routes it):

    proxy ──▶ prefill instance: the prompt, max_tokens 1       ──▶ first token + transfer id
          ──▶ decode instance: the request, first token, id    ──▶ pulls the prompt's KV from the
                                                                   prefill instance, then decodes
                                                                   and streams the rest

On the prefill instance (`PrefillSide`) a request marked `keep_kv` runs as usual; when it ends
at its length limit (its one token), the scheduler keeps its blocks (`RemoteKVScheduler.kept`)
until the KV connector has copied them out (`KVConnector.send`); then they go back to the pool.

On the decode instance (`DecodeSide`) the request waits, outside the scheduler, for blocks of its
own (`RemoteKVScheduler.reserve`); then the connector brings the prompt's KV into them, and once
it has landed the request joins the running set as a sequence whose prompt is already computed,
with its first token appended (`RemoteKVScheduler.add_computed`): to the scheduler, a prefix-cache
hit of the whole prompt. From there it is an ordinary sequence: decoded, preempted (and then
recomputed here, like any other), aborted. A transfer that fails or times out fails its request
only.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from nanoserve.attention.paged import PagedKVCache
from nanoserve.engine.config import EngineConfig
from nanoserve.runner.kv_connector import KVConnector, Landed, make_connector
from nanoserve.sampling.params import SamplingParams
from nanoserve.scheduler.remote_kv import RemoteKVScheduler
from nanoserve.scheduler.sequence import Sequence


@dataclass
class KVTransfer:
    """What the proxy carries from the prefill instance to the decode instance for one request."""

    transfer_id: str
    prompt_token_ids: list[int]
    first_token: int

    def to_dict(self) -> dict:
        return dict(transfer_id=self.transfer_id, prompt_token_ids=self.prompt_token_ids, first_token=self.first_token)

    @classmethod
    def from_dict(cls, d: object, vocab_size: int) -> "KVTransfer":
        """From the JSON the prefill instance answered; ValueError, with what is wrong, for anything else."""
        def token(t: object) -> bool:
            return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size

        ok = isinstance(d, dict) and isinstance(d.get("transfer_id"), str) and token(d.get("first_token")) \
            and isinstance(d.get("prompt_token_ids"), list) and d["prompt_token_ids"] \
            and all(token(t) for t in d["prompt_token_ids"])
        if not ok:
            raise ValueError("'kv_transfer_params' must be what a prefill instance answered: an object with "
                             "'transfer_id' (a string), 'prompt_token_ids' and 'first_token' (token ids, in "
                             f"[0, {vocab_size}))")
        return cls(d["transfer_id"], list(d["prompt_token_ids"]), d["first_token"])


class PrefillSide:
    """A prefill instance's part: send the KV of each finished request that asked for it."""

    def __init__(self, connector: KVConnector):
        self.connector = connector

    @staticmethod
    def check(params: SamplingParams) -> None:
        if params.max_tokens != 1:
            raise ValueError(f"a request whose KV goes to a decode instance samples one token on the prefill "
                             f"instance: max_tokens must be 1, not {params.max_tokens}")

    def send(self, seq: Sequence, scheduler: RemoteKVScheduler) -> KVTransfer | None:
        """`seq` has finished. If the scheduler kept its blocks (it ended at its one token, not at a
        stop token), copy them out through the connector and free them; returns what the decode
        instance needs to take over, or None when the request is complete already."""
        # >>> week21: send-blocks
        if seq.seq_id not in scheduler.kept:
            return None
        transfer = KVTransfer(uuid.uuid4().hex, seq.prompt_ids, seq.output_ids[0])
        try:
            self.connector.send(transfer.transfer_id, scheduler.kept[seq.seq_id])
        finally:
            scheduler.release_kept(seq.seq_id)
        return transfer
        # <<< week21: send-blocks


@dataclass
class Arrival:
    """A request on the decode instance whose prompt's KV is still to come."""

    seq: Sequence
    transfer: KVTransfer
    receiving: bool = False  # blocks reserved and the transfer started


class DecodeSide:
    """A decode instance's part: requests whose KV is on its way, in arrival order."""

    def __init__(self, connector: KVConnector):
        self.connector = connector
        self.arrivals: dict[int, Arrival] = {}  # seq_id -> arrival (dicts keep their insertion order)

    def add(self, seq: Sequence, transfer: KVTransfer) -> None:
        self.arrivals[seq.seq_id] = Arrival(seq, transfer)

    def poll(self, scheduler: RemoteKVScheduler) -> list[tuple[Sequence, Landed]]:
        """Start the transfers that now have blocks (first come, first served: nobody overtakes a
        request that waits for blocks), then take in those that landed: each joins the scheduler's
        running set, or, when its transfer failed, gives its blocks back and finishes with "error".
        Returns the sequences whose transfer finished, with how."""
        # >>> week21: land-transfers
        for arrival in self.arrivals.values():
            if not arrival.receiving:
                if not scheduler.reserve(arrival.seq):
                    break
                self.connector.receive(arrival.transfer.transfer_id, arrival.seq.block_table)
                arrival.receiving = True
        by_transfer = {a.transfer.transfer_id: a for a in self.arrivals.values()}
        finished = []
        for landed in self.connector.landed():
            arrival = by_transfer.get(landed.transfer_id)
            if arrival is None:
                continue  # aborted meanwhile
            del self.arrivals[arrival.seq.seq_id]
            if landed.error is None:
                scheduler.add_computed(arrival.seq, arrival.transfer.first_token)
            else:
                scheduler.finish(arrival.seq, "error")  # its blocks go back
            finished.append((arrival.seq, landed))
        return finished
        # <<< week21: land-transfers

    def abort(self, seq_id: int) -> None:
        """Forget a request aborted before its KV landed (the caller finishes it, which frees its
        blocks); the prefill instance lets its copy go."""
        arrival = self.arrivals.pop(seq_id, None)
        if arrival is not None:
            self.connector.cancel(arrival.transfer.transfer_id)


def disaggregation_sides(c: EngineConfig, cache: PagedKVCache) -> tuple[PrefillSide | None, DecodeSide | None]:
    """An engine's role in a disaggregated pair, with its KV connector over the engine's pool
    `cache`: (PrefillSide, None), (None, DecodeSide), or (None, None) for an engine that does both."""
    if c.kv_role is None:
        return None, None
    if c.world_size > 1:
        raise ValueError(f"--role {c.kv_role} runs on one GPU per instance: tensor and pipeline parallelism "
                         "do not move KV between instances yet")
    connector = make_connector(c.kv_connector, cache, c.kv_role, c.kv_address, c.kv_transfer_timeout)
    return (PrefillSide(connector), None) if c.kv_role == "prefill" else (None, DecodeSide(connector))


def check_kv_transfer(role: str | None, kv_transfer: dict | None, params: SamplingParams,
                      vocab_size: int) -> KVTransfer | None:
    """A request's `kv_transfer` on an engine of `role`: the transfer a decode instance takes over,
    None otherwise; ValueError, in one line, for what this role cannot serve."""
    if kv_transfer is None:
        return None
    if role is None:
        raise ValueError("'kv_transfer_params' is for disaggregated serving: this engine was started without "
                         "--role prefill or --role decode")
    if params.logprobs is not None or params.prompt_logprobs is not None:
        raise ValueError("logprobs are not available with disaggregated prefill and decode yet")
    if role == "prefill":
        if kv_transfer != {"send": True}:
            raise ValueError('a prefill instance takes \'kv_transfer_params\': {"send": true}')
        PrefillSide.check(params)
        return None
    return KVTransfer.from_dict(kv_transfer, vocab_size)
