"""A stand-in for `statekeeper serve` and its users, for the harness's tests: no model, no subprocess, no HTTP."""

from __future__ import annotations

import json
from pathlib import Path

MEASUREMENT = "dense-rows.json"  # what a start measures into its profiles directory when it finds none there
MEASURED = {"kv_dtype": "bfloat16", "gemm": "bfloat16", "gemm_rows": 16}  # what a fake start measures


class FakeService:
    """Records each start: the data directory, the settings, and whether it measured (as the service does where
    restore planning is on and its profiles directory lacks the measurements). `starts` is shared by every
    instance: reset it in each test."""

    starts: list[dict] = []
    measured_in: dict[Path, dict] = {}  # a checkout whose start measures otherwise (its own format): what it chooses

    def __init__(self, data_dir: Path, env: dict[str, str], own_process_group: bool = False,
                 poll_seconds: float = 0.5, repo: Path | None = None):
        self.data_dir, self.env, self.repo = data_dir, env, repo
        self.url = f"fake://{data_dir.name}"

    def start(self, timeout_s: float = 600) -> float:
        measurement = self.data_dir / "profiles" / MEASUREMENT
        measured = self.env.get("STATEKEEPER_RESTORE_PLANNING") != "false" and not measurement.exists()
        if measured:
            measurement.parent.mkdir(parents=True, exist_ok=True)
            measurement.write_text(json.dumps({"cpu": "fake"}))
        (self.data_dir / "serve.log").write_text("")
        FakeService.starts.append({"data_dir": self.data_dir, "env": self.env, "repo": self.repo,
                                   "measured": measured, "url": self.url})
        return 1.0

    def stop(self, timeout_s: float = 300) -> float:
        return 0.5

    @staticmethod
    def admin(url: str) -> dict:
        """GET /v1/admin/tiers's choices from the service at `url`: what its settings name, else what it measured;
        no GEMM where it measured nothing at start (RESTORE_PLANNING=false), as the service reports them."""
        start = next(start for start in FakeService.starts if start["url"] == url)
        env, measured = start["env"], MEASURED | FakeService.measured_in.get(start["repo"], {})
        planning = env.get("STATEKEEPER_RESTORE_PLANNING") != "false"
        rows = int(env.get("STATEKEEPER_GEMM_ROWS", measured["gemm_rows"]))
        return {"kv_dtype": {"dtype": env.get("STATEKEEPER_KV_DTYPE", measured["kv_dtype"])},
                "dense_rows": {"rows": rows, "gemm": measured["gemm"]} if planning else None}


def turn(user: int, round_: int, ttft_ms: float = 100.0, latency_ms: float = 500.0, error: str | None = None,
         source: str | None = None) -> dict:
    """One multiround turn record as send_turn writes it (a failed one carries only its error)."""
    record = {"user": user, "round": round_, "gap_s": 0.0}
    if error is not None:
        return record | {"status": 500, "error": error}
    return record | {"status": 200, "error": None, "source": source or ("first" if round_ == 0 else "dram"),
                     "ttft_ms": ttft_ms, "latency_ms": latency_ms, "completion_tokens": 10}
