"""The live KV cache's dtype where KV_DTYPE=auto, chosen by measurement on the machine the service runs on.

Which dtype decodes faster depends on the CPU's kernels: on an Intel Xeon with AMX a bfloat16 cache reads half
the bytes and attends as fast, on an AMD EPYC (Zen 4) bfloat16 attention was 1.6x slower than float32 (issue
31). So the candidates whose fidelity is known are each timed on the live model: a decode step at CONTEXT
tokens and a batched step of BATCH conversations, and the one with the least time a token wins. The candidates
are the model's own dtype and, for the bundled model computing in float32, bfloat16 (its fidelity against
float32, from `statekeeper eval`: BENCHMARKS.md "A bfloat16 KV cache"); other models keep their own dtype, since
no other has been measured for them. The choice is cached beside the restore profile, per model, device,
thread count and CPU, so a restart keeps it (the stored KV's fingerprint names its dtype); an explicit
KV_DTYPE always wins."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from statekeeper.batch_forward import Segment
from statekeeper.machine import load_timings, machine_id, measurement_path, median_ms, save_measurement
from statekeeper.model_loader import resolve_kv_dtype
from statekeeper.worker import ModelWorker

log = logging.getLogger(__name__)

CONTEXT = 512  # tokens a timed conversation holds
BATCH = 4  # conversations in the timed batched step
STEPS = 6  # timed steps of each kind (the median counts), after one that warms up


@dataclass(frozen=True, slots=True)
class DtypeTiming:
    dtype: str
    decode_ms: float  # one conversation's decode step at CONTEXT tokens
    batched_ms: float  # one step of BATCH conversations at CONTEXT tokens each

    @property
    def ms_per_token(self) -> float:
        """The mean of the two ways a token is made: alone, and in a batch (its share of the step)."""
        return (self.decode_ms + self.batched_ms / BATCH) / 2


@dataclass(frozen=True, slots=True)
class KVDtypeChoice:
    dtype: str
    reason: str
    cpu: str = ""
    timings: list[DtypeTiming] = field(default_factory=list)

    def report(self) -> dict:
        """For the admin stats: what was chosen, why, and each candidate's times."""
        return {"dtype": self.dtype, "reason": self.reason, "cpu": self.cpu,
                "timings": [asdict(t) | {"ms_per_token": t.ms_per_token} for t in self.timings]}

    @classmethod
    def unmeasured(cls, dtype: torch.dtype) -> KVDtypeChoice:
        """A service started without the start-up profile keeps what the setting's rule gave."""
        return cls(dtype_name(dtype), "KV_DTYPE's rule, not measured (no start-up profile)")

    def note(self) -> str:
        """For /healthz notes."""
        return f"KV cache dtype {self.dtype}: {self.reason}"


def fastest(timings: list[DtypeTiming]) -> DtypeTiming:
    """The candidate with the least time a token (the first listed, the model's own dtype, on a tie)."""
    return min(timings, key=lambda timing: timing.ms_per_token)


def candidates(worker: ModelWorker) -> list[torch.dtype]:
    """The model's own dtype, and the other dtype whose fidelity is known for this model, if any."""
    other = resolve_kv_dtype("auto", worker.is_bundled, worker.dtype)
    return [worker.dtype] if other == worker.dtype else [worker.dtype, other]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def time_dtype(worker: ModelWorker, dtype: torch.dtype) -> DtypeTiming:
    """On the model thread: `worker`'s decode and batched steps with its KV in `dtype` (left in that dtype)."""
    worker.use_kv_dtype(dtype)
    vocab = worker.model.get_input_embeddings().num_embeddings
    tokens = [(7 * i) % (vocab - 5) + 5 for i in range(CONTEXT)]
    caches = [worker.new_cache() for _ in range(BATCH)]
    for cache in caches:
        worker.prefill(cache, tokens)
    decode_ms = median_ms(lambda: worker.decode(caches[0], 42), STEPS)
    batched_ms = median_ms(lambda: worker.step([Segment(cache, [42], None) for cache in caches]), STEPS)
    return DtypeTiming(dtype_name(dtype), decode_ms, batched_ms)


def choose(worker: ModelWorker, directory: Path, setting: str) -> KVDtypeChoice:
    """On the model thread: the KV dtype for `setting` (KV_DTYPE), applied to `worker` (use_kv_dtype). For
    `auto`, the fastest candidate in this machine's timings: measured once, then read from `directory`."""
    if setting != "auto":
        return KVDtypeChoice(setting, "set by KV_DTYPE")
    options = candidates(worker)
    if len(options) == 1:
        return KVDtypeChoice(dtype_name(options[0]), "the model's own dtype (no other measured for this model's fidelity)")
    cpu, path = machine_id(worker.device), timings_path(directory, worker)
    timings = load_timings(path, DtypeTiming, worker.device)
    if timings is None or sorted(t.dtype for t in timings) != sorted(dtype_name(d) for d in options):
        timings = [time_dtype(worker, dtype) for dtype in options]
        save_measurement(path, {"timings": [asdict(t) for t in timings]}, worker.device)
    best = fastest(timings)
    each = ", ".join(f"{t.dtype} {t.ms_per_token:.1f}" for t in timings)
    choice = KVDtypeChoice(best.dtype, f"measured fastest on this CPU (ms a token: {each})", cpu, timings)
    worker.use_kv_dtype(getattr(torch, choice.dtype))
    log.info("%s", choice.note())
    return choice


def timings_path(directory: Path, worker: ModelWorker) -> Path:
    """Where the candidates' timings are kept: per model (its weights), device and thread count."""
    return measurement_path(directory, "kv-dtype", worker.model_fingerprint, worker)
