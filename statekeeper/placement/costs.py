"""What a return costs in each form and place, and what compressing costs: the cost profile the placement
policy weighs conversations by and the simulator estimates first tokens with. A profile is a JSON file
(statekeeper/simulation/profiles/ ships some, each saying where its numbers come from); the service builds
its own from the restore profile it measures at start (statekeeper/profile.py) and its model's KV size."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from scheduler.plan import ComputeProfile, LoadProfile


# Priors until the service has seen its own compressions (MeasuredCompression): the default compression's KVzip
# scoring, measured at 1.3-1.5 prefills of CPU on one Xeon (BENCHMARKS.md, issue 13), is most of its cost;
# each prior counts as PRIOR_WEIGHT compressions, so the first few measured ones (a cold child) do not swing it.
SCORING_PREFILLS = 1.4
PRIOR_WEIGHT = 2.0


@dataclass(frozen=True, slots=True)
class CostProfile:
    bytes_per_token: int  # an exact stored blob's, per history token
    compute: ComputeProfile  # prefill (recompute) ms of a prefix of n tokens
    tiers: dict[str, LoadProfile]  # reading a stored blob from each tier
    compression_ratio: float = 8.0  # exact bytes over compressed
    compressed_decode_ms_per_token: float = 0.0  # decoding a compressed blob, on top of reading it
    compress_ms_linear: float = 0.0  # CPU ms to compress a blob of n tokens: linear * n + quadratic * n^2
    compress_ms_quadratic: float = 0.0
    compress_workers: int = 1  # cores the compactor has
    name: str = ""
    notes: list[str] = field(default_factory=list)  # where each number comes from

    @classmethod
    def of_service(cls, bytes_per_token: int, compute: ComputeProfile | None, tiers: dict[str, LoadProfile]
                   ) -> "CostProfile":
        """The service's own, from the restore profile it measured at start (none: a token-counting one).
        Compressing starts as SCORING_PREFILLS prefills of the blob's tokens, and the compression ratio at
        the default codec's 8x; both then follow what the service's compressions measure (MeasuredCompression)."""
        if compute is None:
            return cls.tokens_only(bytes_per_token)
        return cls(bytes_per_token, compute, dict(tiers), compress_ms_linear=SCORING_PREFILLS * compute.linear_ms,
                   compress_ms_quadratic=SCORING_PREFILLS * compute.quadratic_ms, name="measured at start")

    @classmethod
    def tokens_only(cls, bytes_per_token: int, compression_ratio: float = 8.0,
                    tiers: tuple[str, ...] = ("dram", "lmdb", "ssd", "redis")) -> "CostProfile":
        """Counts tokens, not time: a recompute costs 1 ms a token, a restore and compressing nothing."""
        free = LoadProfile(0.0, math.inf)
        return cls(bytes_per_token, ComputeProfile(0.0, 1.0, 0.0), {name: free for name in tiers}, compression_ratio,
                   name="tokens only")

    def with_workers(self, workers: int) -> "CostProfile":
        if workers < 1:
            raise ValueError("compress_workers must be >= 1")
        return dataclasses.replace(self, compress_workers=workers)

    def recompute_ms(self, tokens: int) -> float:
        return self.compute.prefill_ms(tokens)

    def extend_ms(self, history: int, new: int) -> float:
        """Prefilling `new` tokens after `history` cached ones: the longer prefix's time less the shorter's."""
        return max(self.compute.prefill_ms(history + new) - self.compute.prefill_ms(history),
                   self.compute.prefill_ms(new) if history == 0 else 0.0)

    def stored_bytes(self, tokens: int, compressed: bool) -> int:
        exact = tokens * self.bytes_per_token
        return max(1, round(exact / self.compression_ratio)) if compressed else exact

    def restore_ms(self, tier: str, tokens: int, compressed: bool) -> float:
        """Reading the blob from `tier` into a cache, decoding it if compressed (the worst case: the service
        overlaps part of it with the new message's prefill)."""
        load = self.tiers.get(tier)
        read = load.read_ms(self.stored_bytes(tokens, compressed)) if load is not None else 0.0
        return read + (self.compressed_decode_ms_per_token * tokens if compressed else 0.0)

    def saved_ms(self, tier: str, tokens: int, compressed: bool) -> float:
        """What keeping the blob in `tier` saves a return against recomputing its history."""
        return max(0.0, self.recompute_ms(tokens) - self.restore_ms(tier, tokens, compressed))

    def compress_cpu_ms(self, tokens: int) -> float:
        return self.compress_ms_linear * tokens + self.compress_ms_quadratic * tokens * tokens

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)  # the compute and tier profiles with it, as from_dict reads them

    @classmethod
    def from_dict(cls, data: dict) -> "CostProfile":
        """Raises ValueError (or KeyError, TypeError) on a malformed profile: read once, at the boundary."""
        profile = cls(int(data["bytes_per_token"]), ComputeProfile.from_dict(data["compute"]),
                      {name: LoadProfile.from_dict(tier) for name, tier in data["tiers"].items()},
                      float(data.get("compression_ratio", 8.0)),
                      float(data.get("compressed_decode_ms_per_token", 0.0)),
                      float(data.get("compress_ms_linear", 0.0)), float(data.get("compress_ms_quadratic", 0.0)),
                      int(data.get("compress_workers", 1)), str(data.get("name", "")), list(data.get("notes", [])))
        if profile.bytes_per_token <= 0 or profile.compression_ratio < 1 or profile.compress_workers < 1:
            raise ValueError("a cost profile needs bytes_per_token > 0, compression_ratio >= 1, compress_workers >= 1")
        return profile

    @classmethod
    def load(cls, path: Path) -> "CostProfile":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


@dataclass(slots=True)
class MeasuredCompression:
    """What the service's own compressions did, so the profile's compression ratio and compression CPU follow
    this machine, model and workload rather than the priors it started with: the exact and compressed bytes
    of each blob, and the CPU it took over the prefill of its tokens (where the compression process said)."""

    prior: CostProfile
    exact_bytes: int = 0
    stored_bytes: int = 0
    blobs: int = 0
    prefills_sum: float = 0.0  # each measured compression's CPU over the prefill of its tokens
    timed: int = 0

    def add(self, tokens: int, exact_bytes: int, stored_bytes: int, cpu_ms: float | None) -> None:
        if tokens <= 0 or exact_bytes <= 0 or stored_bytes <= 0:
            return
        self.exact_bytes += exact_bytes
        self.stored_bytes += stored_bytes
        self.blobs += 1
        prefill_ms = self.prior.compute.prefill_ms(tokens)
        if cpu_ms is not None and prefill_ms > 0:
            self.prefills_sum += cpu_ms / prefill_ms
            self.timed += 1

    def profile(self) -> CostProfile:
        """The prior profile with the measured ratio and CPU, each weighed against its prior."""
        prior, prior_prefills = self.prior, self.prior_prefills()
        scale = self.prefills() / prior_prefills if prior_prefills else 1.0
        return dataclasses.replace(prior, compression_ratio=self.ratio(),
                                   compress_ms_linear=prior.compress_ms_linear * scale,
                                   compress_ms_quadratic=prior.compress_ms_quadratic * scale)

    def ratio(self) -> float:
        """Exact bytes over compressed, the prior counting as PRIOR_WEIGHT blobs of the mean size seen."""
        if not self.blobs:
            return self.prior.compression_ratio
        prior_exact = PRIOR_WEIGHT * self.exact_bytes / self.blobs
        return max(1.0, (prior_exact + self.exact_bytes)
                   / (prior_exact / self.prior.compression_ratio + self.stored_bytes))

    def prefills(self) -> float:
        """Compressing, in prefills of the blob's tokens (CPU), the prior counting as PRIOR_WEIGHT compressions."""
        return (PRIOR_WEIGHT * self.prior_prefills() + self.prefills_sum) / (PRIOR_WEIGHT + self.timed)

    def prior_prefills(self) -> float:
        """The prior's compression CPU in prefills (of a 1,000-token blob: a profile file may not be linear);
        0 for a profile without compression CPU (a token-counting one: no restore profile was measured)."""
        prefill_ms = self.prior.compute.prefill_ms(1000)
        return self.prior.compress_cpu_ms(1000) / prefill_ms if prefill_ms > 0 else 0.0

    def report(self) -> dict:
        """What it weighs by now (compress_prefills None: the profile has no compression CPU to scale)."""
        return {"compressions_seen": self.blobs, "compressions_timed": self.timed,
                "compression_ratio": round(self.ratio(), 3),
                "compress_prefills": round(self.prefills(), 3) if self.prior_prefills() else None}
