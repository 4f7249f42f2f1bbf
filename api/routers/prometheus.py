"""/metrics: Prometheus text format (statekeeper/metrics.py says what is in it)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import PlainTextResponse

from api.deps import MetricsReaderDep, ServiceDep
from api.schemas import json_error_responses
from statekeeper.metrics import CONTENT_TYPE

router = APIRouter(tags=["metrics"], responses=json_error_responses(401, 403, 413))


@router.get("/metrics", response_class=PlainTextResponse, response_description="Prometheus text format")
async def read_metrics(service: ServiceDep, _: MetricsReaderDep) -> Response:
    """Counters, histograms and gauges of turns, tiers, the model thread, compression and HTTP requests;
    the admin token is needed unless STATEKEEPER_METRICS_PUBLIC=true."""
    # On the event loop's thread (an async route): the scrape reads sessions that only the loop changes.
    return Response(service.metrics.exposition(), media_type=CONTENT_TYPE)
