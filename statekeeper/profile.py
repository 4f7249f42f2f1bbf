"""Hardware profile for restore planning (`statekeeper profile`): how long recomputing a prefix takes
on this device and thread count, and how fast each enabled tier reads. Cached per model fingerprint,
device and thread count, for the machine it was measured on (statekeeper/machine.py); the service loads it at
start and measures a quick one if none exists there, and the tiers it lacks (unreachable then, or added since)."""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kernels.weight_linear import many_row_products
from scheduler.plan import ComputeProfile, LoadProfile, increasing_points
from statekeeper.machine import load_measurement, measurement_path, save_measurement
from statekeeper.worker import ModelWorker

log = logging.getLogger(__name__)
QUICK_LENGTHS = (64, 128, 256)
FULL_LENGTHS = (32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096)
QUICK_PROBE_TOKENS = (128, 1024)  # stored-state sizes the tiers are timed at
FULL_PROBE_TOKENS = (128, 512, 1024, 2048, 4096)
PROBE_KEY = "statekeeper-profile-probe"
# A restored conversation has been idle: its blob and the cache's memory are no longer in the CPU's
# caches (a turn's prefill streams ~0.5 GB of weights through them). Writing this much before each timed
# probe read keeps the probe from reading a blob the previous repeat left warm, which timed a 573-token
# load 10-20% faster than the restores it plans (BENCHMARKS.md, restore pipeline run 9).
CACHE_EVICTION_BYTES = 256 << 20


@dataclass(slots=True)
class HardwareProfile:
    model: str
    device: str
    threads: int
    compute: ComputeProfile
    tiers: dict[str, LoadProfile]
    kernels: str = ""  # the many-row products the prefills were timed on (kernels/weight_linear.py)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "HardwareProfile":
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: dict) -> "HardwareProfile":
        return cls(data["model"], data["device"], int(data["threads"]), ComputeProfile.from_dict(data["compute"]),
                   {name: LoadProfile.from_dict(tier) for name, tier in data["tiers"].items()},
                   str(data.get("kernels", "")))


def profile_path(directory: Path, worker: ModelWorker) -> Path:
    # v4: prefill timed on the GEMM statekeeper/dense_rows_choice.py picks, float32 where bfloat16 is emulated
    # (about half the time a token of v3's on such a CPU): older profiles are measured again
    return measurement_path(directory, "restore-v4", worker.fingerprint, worker)


def measure_compute(worker: ModelWorker, lengths=QUICK_LENGTHS, repeats: int = 3) -> ComputeProfile:
    samples, vocab = [], worker.model.get_input_embeddings().num_embeddings
    for length in lengths:
        tokens = [(7 * i) % (vocab - 5) + 5 for i in range(length)]
        times = []
        for _ in range(repeats):
            cache = worker.new_cache()
            started = time.perf_counter()
            worker.prefill(cache, tokens)
            if worker.device.type == "cuda":  # the forward was only queued
                torch.cuda.synchronize(worker.device)
            times.append((time.perf_counter() - started) * 1e3)
        samples.append((length, statistics.median(times)))
    return ComputeProfile.fit(samples)


def measure_tier(tier, worker: ModelWorker, sizes_tokens=QUICK_PROBE_TOKENS, repeats: int = 5) -> LoadProfile:
    """Load time of stored states of a few lengths, timed on the restore path itself: the tier's view of
    a blob in the model's layout copied into a freshly reserved cache by the pipeline's loader (r = 0).
    A plain copy into one buffer reads about twice as fast as this (the cache's per-layer, per-head
    rows are strided and newly reserved), which made plans for fast tiers optimistic; each timed read
    starts with the CPU caches holding something else (CACHE_EVICTION_BYTES). Latency and
    bandwidth come from the least-squares line through the points (a 4k-token probe keeps long
    restores from being extrapolated from short ones)."""
    from scheduler.plan import RestorePlan
    from statekeeper.restore_pipeline import restore_pipelined
    from storage import serialization

    points = []
    eviction = torch.empty(CACHE_EVICTION_BYTES, dtype=torch.uint8) if worker.device.type == "cpu" else None
    for tokens in sizes_tokens:
        history = list(range(tokens))
        shape = (worker.num_kv_heads, tokens, worker.head_dim)
        layers = [(torch.randn(shape, dtype=worker.kv_dtype), torch.randn(shape, dtype=worker.kv_dtype))
                  for _ in range(worker.num_layers)]
        tier.put(PROBE_KEY, serialization.encode(layers, worker.fingerprint, history))
        try:
            times = []
            for attempt in range(repeats + 1):  # the first read only maps the blob's pages: not timed
                with tier.read(PROBE_KEY) as view:
                    _, stored = serialization.decode(view, worker.fingerprint, history)
                    if eviction is not None:
                        eviction.fill_(attempt)
                    started = time.perf_counter()
                    restore_pipelined(worker, stored, history, RestorePlan(tokens, 0, 0.0, 0.0))
                    if attempt:
                        times.append((time.perf_counter() - started) * 1e3)
                    del stored
        finally:
            tier.delete(PROBE_KEY)
        points.append((sum(k.nbytes + v.nbytes for k, v in layers), statistics.median(times)))
    mean_bytes = statistics.fmean(b for b, _ in points)
    mean_ms = statistics.fmean(t for _, t in points)
    slope = (sum((b - mean_bytes) * (t - mean_ms) for b, t in points)
             / sum((b - mean_bytes) ** 2 for b, _ in points))
    per_byte = max(1e-9, slope)  # ms per byte
    return LoadProfile(max(0.0, mean_ms - per_byte * mean_bytes), 1e-3 / per_byte, increasing_points(points))


def measure_tiers(worker: ModelWorker, tiers, probe_tokens=QUICK_PROBE_TOKENS) -> dict[str, LoadProfile]:
    loads = {}
    for tier in tiers:
        try:
            loads[tier.name] = measure_tier(tier, worker, probe_tokens)
        except Exception as exc:  # an unreachable tier gets no profile (measured at a later start)
            log.warning("could not profile tier %s: %s", tier.name, exc)
    return loads


def measure(worker: ModelWorker, tiers, lengths=QUICK_LENGTHS, probe_tokens=QUICK_PROBE_TOKENS) -> HardwareProfile:
    return HardwareProfile(worker.fingerprint, worker.device.type, worker.config.num_threads,
                           measure_compute(worker, lengths), measure_tiers(worker, tiers, probe_tokens),
                           many_row_products(worker.model.modules()))


def save(path: Path, profile: HardwareProfile, worker: ModelWorker) -> None:
    save_measurement(path, asdict(profile), worker.device)


def load_or_measure(directory: Path, worker: ModelWorker, tiers) -> HardwareProfile:
    """This machine's profile as kept in `directory`, with the tiers it lacks measured; else a quick one."""
    path = profile_path(directory, worker)
    data, profile = load_measurement(path, worker.device), None
    if data is not None:
        try:
            profile = HardwareProfile.from_dict(data)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # parsed, but not a profile's fields
            log.warning("re-measuring: unreadable restore profile %s (%s)", path, exc)
    if profile is not None and profile.kernels != many_row_products(worker.model.modules()):
        log.info("re-measuring: the restore profile was timed on other many-row products (%s)", profile.kernels)
        profile = None
    if profile is None:
        log.info("measuring a quick restore profile (statekeeper profile measures a fuller one)")
        profile = measure(worker, tiers)
    else:
        missing = [tier for tier in tiers if tier.name not in profile.tiers]
        if not missing:
            return profile
        profile = dataclasses.replace(profile, tiers=profile.tiers | measure_tiers(worker, missing))
    save(path, profile, worker)
    return profile


def main(argv: list[str] | None = None) -> None:
    """`statekeeper profile`: measure recompute cost and tier reads, and cache them for the service."""
    import argparse

    from statekeeper.service_worker import load_service_worker
    from statekeeper.settings import load_settings
    from storage.factory import build_tier_manager

    parser = argparse.ArgumentParser(prog="statekeeper profile", description=main.__doc__)
    parser.add_argument("--config")
    parser.add_argument("--data-dir")
    parser.add_argument("--model")
    parser.add_argument("--lengths", default=",".join(map(str, FULL_LENGTHS)))
    args = parser.parse_args(argv)
    config = load_settings(args.config, data_dir=args.data_dir, model=args.model).to_config()
    config.data_dir.mkdir(parents=True, exist_ok=True)
    # As the service builds it (its dtype and device, the kernels the timings below run on, the dtype it keeps
    # its KV in): the profile is kept per fingerprint, which names them
    worker, dense_rows, kv_dtype = load_service_worker(dataclasses.replace(config, restore_planning=True))
    for choice in (dense_rows, kv_dtype):
        if choice is not None:
            print(choice.note())
    tiers = build_tier_manager(config.tiers, config.tier_index_path, config.promote_on_read)
    try:
        profile = measure(worker, tiers.tiers, [int(x) for x in args.lengths.split(",")], FULL_PROBE_TOKENS)
    finally:
        tiers.close()
    path = profile_path(config.profile_dir, worker)
    save(path, profile, worker)
    c = profile.compute
    print(f"{path}\nrecompute: {c.fixed_ms:.1f} ms + {c.linear_ms:.3f} ms/token + {c.quadratic_ms:.2e} ms/token^2")
    for name, tier in profile.tiers.items():
        print(f"{name}: {tier.latency_ms:.2f} ms + {tier.megabytes_per_s:.0f} MB/s")
