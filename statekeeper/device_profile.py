"""The restore profile of a GPU worker, measured at start: host-to-device bandwidth from pinned memory
(PCIe or the chip-to-chip link), how fast a compressed blob decodes on the device, and what a prefill
costs there. The planner balances T_C (recompute the prefix, then the new message) against T_L (copy the
rest) with these numbers, as it does with the CPU's (statekeeper/profile.py).

Timed with CUDA events, never the host's clock alone: a GPU call returns once queued."""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass

import torch

from scheduler.plan import ComputeProfile, LoadProfile, RestorePlan, StoredLayer, increasing_points, plan_restore
from statekeeper.profile import measure_compute
from statekeeper.worker import ModelWorker

log = logging.getLogger(__name__)

COPY_SIZES = (1 << 20, 16 << 20, 128 << 20)  # bytes: the line's latency and its bandwidth
# Prefill lengths timed at start, up to the model's context. On a GPU a forward of a few thousand tokens or
# fewer costs its host time whatever its length (25-40 ms on an H100 and an H200 for SmolLM2's and Llama
# 8B's shapes up to 2k tokens, while 16k tokens took 185 and 752 ms: BENCHMARKS.md, issue 34), so lengths
# that stop there fit a per-token cost of about nothing and plan long recomputes as nearly free.
PROFILE_LENGTHS = (1024, 4096, 16384)
# And one short forward, for what every forward pays there, the new message's included: fitted through the
# long ones alone, a 48-token message came out at ~1 ms, and the planner recomputed 963 tokens of an 8B 16k
# restore in a forward of their own (2.13x hot instead of 1.20x on an H100: BENCHMARKS.md, issue 34).
SHORT_PREFILL = 64


def profile_lengths(context_length: int, lengths=PROFILE_LENGTHS, short: int = SHORT_PREFILL) -> tuple[int, ...]:
    """`lengths` within the model's context: three distinct ones (the fit needs three), the longest the
    context itself where it is shorter than the longest asked; `short` before them where it is shorter."""
    within = sorted({length for length in lengths if 4 * length <= 3 * context_length}  # spread, not 4096 and 4097
                    | {min(max(lengths), context_length)})
    if len(within) >= 3:
        chosen = tuple(within[-3:])
    else:
        longest = within[-1]
        chosen = tuple(sorted({max(1, longest // 16), max(2, longest // 4), longest}))
    return ((short,) if short < chosen[0] else ()) + chosen


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    device: str  # the GPU's name
    pcie: LoadProfile  # pinned host memory to the device
    decode_mb_per_s: float | None  # a compressed blob's stored bytes decoded per second there; None: not measured
    compute: ComputeProfile

    def summary(self) -> dict:
        return {"device": self.device, "pcie_gb_per_s": round(self.pcie.megabytes_per_s / 1e3, 2),
                "pcie_latency_ms": round(self.pcie.latency_ms, 4),
                "decode_gb_per_s": None if self.decode_mb_per_s is None else round(self.decode_mb_per_s / 1e3, 2),
                "prefill_ms_per_token": round(self.compute.linear_ms, 5),
                "prefill_ms": {tokens: round(ms, 3) for tokens, ms in self.compute.samples}}


def device_time_ms(work, repeats: int, warmups: int = 1) -> float:
    """Median device time of `work()` between two events on the current stream (after `warmups` runs)."""
    for _ in range(warmups):
        work()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure_pcie(device: torch.device, sizes=COPY_SIZES, repeats: int = 5) -> LoadProfile:
    """Copies of `sizes` bytes from pinned host memory: latency and bandwidth by least squares."""
    points = []
    for size in sizes:
        host = torch.empty(size, dtype=torch.uint8).pin_memory()
        target = torch.empty(size, dtype=torch.uint8, device=device)
        points.append((size, device_time_ms(lambda: target.copy_(host, non_blocking=True), repeats)))
    mean_bytes = statistics.fmean(b for b, _ in points)
    mean_ms = statistics.fmean(t for _, t in points)
    slope = max(1e-12, sum((b - mean_bytes) * (t - mean_ms) for b, t in points)
                / sum((b - mean_bytes) ** 2 for b, _ in points))
    return LoadProfile(max(0.0, mean_ms - slope * mean_bytes), 1e-3 / slope, increasing_points(points))


def measure_decode(restorer, tensors: dict[str, torch.Tensor], form, history: list[int], repeats: int = 3) -> float:
    """MB/s of stored bytes a compressed restore copies and decodes (no message: the copy stream's work
    alone), from a blob of this model (benchmarks; the service does not measure it yet)."""
    stored_bytes = sum(t.nbytes for t in tensors.values())

    def restore():
        _, _, report = restorer.restore_compressed(tensors, form, history, [])
        return report.timeline()["copy_ms"]

    restore()
    return stored_bytes / 1e3 / statistics.median(restore() for _ in range(repeats))


def measure(worker: ModelWorker, decode_mb_per_s: float | None = None, lengths=None) -> DeviceProfile:
    """PCIe and prefill at start (prefills of `profile_lengths` unless `lengths` are given); the decode rate
    where the caller measured one (`measure_decode`, from a blob of this model: the service has none at
    start, so its plans assume decoding keeps up with the copies)."""
    pcie = measure_pcie(worker.device)
    return DeviceProfile(torch.cuda.get_device_name(worker.device), pcie, decode_mb_per_s,
                         measure_compute(worker, lengths or profile_lengths(worker.context_length)))


def measure_at_start(worker: ModelWorker) -> DeviceProfile | None:
    """The service's profile of its GPU, measured as it starts; None (restores are then not split) where
    measuring fails: a profile is an optimisation, never a reason not to serve."""
    try:
        return measure(worker)
    except Exception as exc:  # out of memory, a driver error: serve without a profile
        log.warning("no GPU restore profile (%s): exact restores will not recompute a prefix", exc)
        return None


def plan(profile: DeviceProfile, num_tokens: int, message_tokens: int, bytes_per_token: float,
         compressed: bool = False) -> RestorePlan:
    """The split of an exact restore (a compressed one is not split: its layers decode whole): r tokens
    recomputed, then the message, on the compute stream (T_C), against copying N - r tokens (T_L). The
    message's forward costs at least a forward of its length (on a GPU, the host's time to queue it) and at
    least what its tokens add to a prefill of the whole history (their attention over it)."""
    compute = profile.compute
    then_ms = max(compute.prefill_ms(message_tokens),
                  compute.prefill_ms(num_tokens + message_tokens) - compute.prefill_ms(num_tokens))
    if compressed:  # copied and decoded, layer by layer, one after the other on the copy stream
        per_byte_ms = 1e-3 / profile.pcie.megabytes_per_s + (1e-3 / profile.decode_mb_per_s if profile.decode_mb_per_s
                                                              else 0.0)
        load_ms = profile.pcie.latency_ms + bytes_per_token * num_tokens * per_byte_ms
        return RestorePlan(num_tokens, 0, then_ms, load_ms)
    return plan_restore(num_tokens, [StoredLayer(bytes_per_token)], compute, profile.pcie, then_ms=then_ms)
