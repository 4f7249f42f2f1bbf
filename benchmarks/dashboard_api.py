"""How fast the admin dashboard's API answers with many stored conversations (issue 16: ≤ 50 ms at 10,000).

    python -m benchmarks.dashboard_api --conversations 10000 --calls 100 --json dashboard.json

Starts `statekeeper serve` (the real model, a fresh data directory) as multiround.py does, creates
--conversations conversations over POST /v1/sessions, runs a few real turns so that tiers and charts hold
something, then times each endpoint the page polls, --calls times each, measured from the client (HTTP on
loopback included): the tier cards, the charts' history, the conversations table's first page, a prefix
search and a page deep in the list.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.multiround import ServiceProcess
from benchmarks.harness import MODEL_CACHE, machine_line, markdown_table, percentile, write_json

PATHS = ("/v1/admin/tiers", "/v1/admin/history", "/v1/admin/conversations?limit=25",
         "/v1/admin/conversations?prefix={prefix}&limit=25", "/v1/admin/conversations?after={middle}&limit=25")


def fill(client: httpx.Client, count: int) -> list[str]:
    ids = [client.post("/v1/sessions", json={}).json()["id"] for _ in range(count)]
    for session in ids[:4]:  # a few real turns and offloads: tier cards and charts with data
        client.post(f"/v1/sessions/{session}/messages", json={"content": "Tell me about Rome.", "max_tokens": 8})
        client.post(f"/v1/sessions/{session}/offload")
    return sorted(ids)


def time_paths(client: httpx.Client, ids: list[str], calls: int, admin: dict) -> list[dict]:
    rows = []
    for template in PATHS:
        path = template.format(prefix=ids[len(ids) // 3][:2], middle=ids[len(ids) // 2])
        client.get(path, headers=admin)  # warm
        times = []
        for _ in range(calls):
            started = time.perf_counter()
            response = client.get(path, headers=admin)
            times.append((time.perf_counter() - started) * 1000)
            assert response.status_code == 200, (path, response.status_code)
        rows.append({"path": template, "median_ms": statistics.median(times), "p95_ms": percentile(times, 0.95),
                     "max_ms": max(times)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=10_000)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--model-cache", type=Path, default=MODEL_CACHE)
    parser.add_argument("--json")
    args = parser.parse_args()
    token = secrets.token_hex(16)
    env = {"STATEKEEPER_MODEL_CACHE_DIR": str(args.model_cache), "STATEKEEPER_ADMIN_TOKEN": token}
    with tempfile.TemporaryDirectory(prefix="statekeeper-dashboard-") as root:
        service = ServiceProcess(Path(root), env)
        service.start()
        try:
            with httpx.Client(base_url=service.url, timeout=120) as client:
                started = time.perf_counter()
                ids = fill(client, args.conversations)
                fill_s = time.perf_counter() - started
                rows = time_paths(client, ids, args.calls, {"Authorization": f"Bearer {token}"})
        finally:
            service.stop()
    print(f"machine: {machine_line()}; {args.conversations:,} conversations "
          f"(created in {fill_s:.1f} s), {args.calls} calls per endpoint\n")
    print(markdown_table(["endpoint", "median ms", "p95 ms", "max ms"],
                         [[f"`{row['path']}`", *(f"{row[key]:.1f}" for key in ("median_ms", "p95_ms", "max_ms"))]
                          for row in rows]))
    if args.json:
        write_json(args.json, {"args": vars(args) | {"model_cache": str(args.model_cache)}, "rows": rows})


if __name__ == "__main__":
    main()
