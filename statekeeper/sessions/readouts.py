"""What the admin API, /metrics, /healthz and the dashboard read of the session service: its stats (the one
source for all of them), their history for the charts, the conversation table, the health check and each
tenant's usage. It reads the service's parts and changes none of them."""

from __future__ import annotations

import asyncio

from statekeeper.memory import heap_bytes
from statekeeper.simulation.forecast import forecast
from statekeeper.simulation.simulator import service_compression
from statekeeper.sessions.admin_rows import AdminRows
from statekeeper.tenancy import TenantLimits


class Readouts:
    def __init__(self, service):
        """`service`: the SessionService whose parts it reads (not imported: the service builds this)."""
        self.service = service
        self.admin_rows = AdminRows(service.history, service.sessions, service.tiers, service.placement.stored_form,
                                    lambda conversation: service.compression.of(conversation.compression).policy,
                                    service.in_io_thread)
        self._forecasting: asyncio.Future | None = None  # the forecast under way, which a second asker awaits

    def stats(self) -> dict:
        """Read it on the event loop's thread: it walks the sessions that the loop changes."""
        service = self.service
        sessions = service.sessions.report()
        return service.executors.stats() | {
            "tiers": service.tiers.stats(),
            "sessions_in_memory": sessions["sessions_in_memory"],
            "active_sessions": sessions["active_sessions"],
            "active_kv_bytes": sessions["active_kv_bytes"],
            "active_kv_budget_bytes": service.config.active_kv_budget_bytes,
            "turns_in_progress": service.turn_runner.in_progress,
            "missing_blobs_at_start": service.tiers.missing_at_start,
            "compression": service.compactor.report(),
            "placement": service.placement_policy.report(),
            "next_turn": service.next_turn.report(),
            "kv_dtype": service.kv_dtype.report(),
            "dense_rows": None if service.dense_rows is None else service.dense_rows.report(),
            # What the service holds that grows with the history rather than the load, against its bounds.
            "memory": {"idle_sessions": sessions["idle_sessions"], "blob_meta": service.stored_forms.report(),
                       "freed_given_back_bytes": service.background.freed_memory.given_back_bytes,
                       "heap": heap_bytes()},
        }

    def stats_history(self) -> dict:
        """The dashboard's charts: samples of the stats over the last hour, and each tier's codec."""
        return self.service.background.stats_history.report() | {"codecs": self.service.placement.tier_codecs()}

    async def forecast(self) -> dict:
        """The service's recent turns (up to RECENT_TURNS) replayed with every tier's budget halved, as it is,
        doubled and quadrupled, under its placement policy and costs (statekeeper/simulation/forecast.py). One
        at a time (a second asker waits for the running one's answer), on a thread of its own: seconds of
        Python on the I/O threads held every turn's history and blob calls, both of them with two askers."""
        if self._forecasting is None or self._forecasting.done():
            self._forecasting = asyncio.ensure_future(self._forecast())
        return await asyncio.shield(self._forecasting)

    async def _forecast(self) -> dict:
        service = self.service
        turns = list(service.feed.recent)
        policy = service.placement_policy.kind
        compression = service_compression(policy, service.compression.of(None).is_lossless)
        tiers = [(tier.name, tier.capacity()) for tier in service.tiers.tiers]
        config = service.config
        rows = await asyncio.to_thread(forecast, turns, tiers, service.placement_policy.costs.with_workers(1),
                                       policy, compression, config.idle_offload_seconds,
                                       config.compress_after_seconds)
        return {"turns": len(turns), "conversations": len({turn.conversation for turn in turns}),
                "policy": policy, "rows": rows}

    async def conversation_page(self, prefix: str = "", after: str = "", limit: int = 50
                                ) -> tuple[list[dict], str | None]:
        """The admin dashboard's table: a page of every tenant's conversations and the id the next page starts
        after (sessions/admin_rows.py)."""
        return await self.admin_rows.page(prefix, after, limit)

    async def conversation_rows(self, prefix: str = "", after: str = "", limit: int = 50) -> list[dict]:
        """The rows of conversation_page."""
        return (await self.conversation_page(prefix, after, limit))[0]

    async def health(self) -> dict:
        """The model, whether each tier is available, and what is missing; raises if the history cannot be
        written (a write with fsync, or a PostgreSQL that may be down until its timeout: off the event loop)."""
        service = self.service
        await service.in_io_thread(service.history.check_writable)
        tiers = [{"name": t["name"], "available": t["available"]}
                 for t in await service.in_io_thread(service.tiers.stats)]
        return {"status": "ok" if all(t["available"] for t in tiers) else "degraded",
                "model": service.worker.fingerprint, "tiers": tiers,
                "notes": service.compression.notes() + [service.kv_dtype.note()]
                + ([] if service.dense_rows is None else [service.dense_rows.note()])}

    async def tenant_usage(self) -> tuple[TenantLimits, list[dict]]:
        """Each tenant's limits (the same for all) and what every tenant with a conversation uses."""
        return self.service.tenants.limits, await self.service.in_io_thread(self.service.tenants.usage)
