"""The engine's reports: what `/metrics`, `/health` and the benchmarks read of it, each a dict of
plain numbers (or None where the feature is off). A mixin of `Engine` (engine.py), kept apart so
that the step loop's file holds the loop."""

from __future__ import annotations

from nanoserve.model.moe import expert_load


class EngineReports:
    """Counters of the engine's parts; `Engine` supplies `scheduler`, `speculator`, `runner`, `config`,
    `model`, `kv_prefill` and `kv_decode`."""

    def kv_transfer_stats(self) -> dict | None:
        """Issue 35: the KV connector's counts (transfers and bytes each way, failures, the seconds the
        received ones took), or None when this engine is not a prefill or decode instance."""
        side = self.kv_prefill or self.kv_decode
        return None if side is None else side.connector.stats()

    def spec_stats(self) -> dict | None:
        """Week 17's counters (guesses proposed and accepted, tokens emitted, sequence-steps
        verified, acceptance rate, tokens per target step), or None without speculation."""
        if self.speculator is None:
            return None
        s = self.speculator.stats
        return dict(proposed=s.num_proposed, accepted=s.num_accepted, emitted=s.num_emitted, steps=s.num_steps,
                    acceptance_rate=s.acceptance_rate, tokens_per_step=s.tokens_per_step)

    def pipeline_stats(self) -> dict | None:
        """Week 20's bubble, measured: each stage's busy and idle share of the steps since the engine
        started (`PipelineRunner.bubble_stats`), or None with one stage."""
        return self.runner.bubble_stats() if self.config.pipeline_parallel_size > 1 else None

    def expert_load(self) -> dict[int, list[int]] | None:
        """Week 24: token-expert pairs routed to each expert since the engine started, by MoE layer (None: a
        dense model); all ranks' (`nanoserve/model/moe.py`, `nanoserve/model/expert_parallel.py`)."""
        return expert_load(self.model)

    def prefix_cache_stats(self) -> dict | None:
        """Week 14's counters (lookups, lookup and hit tokens, hit rate, evictions), or None when
        prefix caching is off. With a CPU tier (`cpu_offload_gb`) also the hits of each tier (GPU
        and CPU hit tokens), the blocks offloaded and reloaded, and the CPU tier's evictions."""
        return self.scheduler.allocator.stats() if self.scheduler.prefix_caching else None

    def held_kv(self) -> dict:
        """Issue 38's held KV: entries and the blocks they hold now (resumes waiting in the queue
        included), and counts since the start: entries held, requests resumed and the prompt tokens
        they skipped, entries evicted for room, entries released."""
        return self.scheduler.held.stats()
