"""How much work on a second model lane slows the model thread's decode steps, and how much of that is the GIL
rather than the cores (issue 30: a next turn's preparation on the long lane runs beside the other users'
decoding).

One process, the service's worker (benchmarks.harness.load_worker: weights and GEMM as the service picks them),
one torch thread per lane as the service runs them on this machine's two cores. The measured thread decodes one
conversation of --context tokens, --steps steps timed one by one; beside it, on a second thread, one of:
- nothing;
- prefill: background jobs as the long lane runs them, --job-tokens tokens each into a conversation of
  --context tokens (a preparation's re-prefill);
- decode: another conversation's decode steps (two decoding lanes);
- gemm: one float32 matrix product after another, large enough that each holds its core for milliseconds with
  the GIL released: the cores' and memory's share of the slowdown, without the GIL's.
Each beside-load runs under the interpreter's default switch interval (5 ms) and under --interval, since a
thread that waits for the GIL waits up to one interval for the holder to let it go. The probes take turns
round by round (--rounds); each figure is the median step over the rounds, each ratio the median of the
rounds' ratios to the step alone in the same round.

    python -m benchmarks.lane_interference --json lane-interference.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import torch

from benchmarks.harness import add_model_arguments, load_worker, machine_line, markdown_table, write_json
from statekeeper.threads import on_own_thread, use_threads
from statekeeper.worker import ModelWorker

BESIDE = ("nothing", "prefill", "decode", "gemm")


class Beside:
    """Runs one kind of load on a thread of its own until stopped."""

    def __init__(self, worker: ModelWorker, kind: str, tokens: list[int], job_tokens: int):
        self.worker, self.kind, self.tokens, self.job_tokens = worker, kind, tokens, job_tokens
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        if self.kind != "nothing":
            self.thread.start()
            time.sleep(0.2)  # under way before the first timed step
        return self

    def __exit__(self, *exc):
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()

    def _run(self) -> None:
        use_threads(1)
        if self.kind == "gemm":
            left, right = torch.randn(1024, 1024), torch.randn(1024, 1024)
            while not self.stop.is_set():
                torch.mm(left, right)
            return
        context = len(self.tokens) - self.job_tokens
        while not self.stop.is_set():
            cache = self.worker.new_cache()
            self.worker.prefill(cache, self.tokens[:context])
            for _ in range(64):
                if self.stop.is_set():
                    return
                if self.kind == "prefill":
                    self.worker.prefill(cache, self.tokens[context:])
                    cache.truncate(context)
                else:
                    self.worker.decode(cache, self.tokens[-1])


def decode_steps_ms(worker: ModelWorker, tokens: list[int], steps: int) -> float:
    """The median of `steps` decode steps on a conversation of `tokens`, on a thread of its own at one torch
    thread (as the model thread runs them on two cores)."""
    return on_own_thread(1, _median_decode_step_ms, worker, tokens, steps)


def _median_decode_step_ms(worker: ModelWorker, tokens: list[int], steps: int) -> float:
    cache = worker.new_cache()
    worker.prefill(cache, tokens)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        worker.decode(cache, tokens[-1])
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--job-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--interval", type=float, default=0.0005, help="the second switch interval, seconds")
    parser.add_argument("--json")
    args = parser.parse_args()
    worker = load_worker(args)
    tokens = torch.randint(100, 40000, (args.context,), generator=torch.Generator().manual_seed(0)).tolist()
    default_interval = sys.getswitchinterval()
    probes = [(kind, interval) for interval in (default_interval, args.interval) for kind in BESIDE]
    times: dict[tuple[str, float], list[float]] = {probe: [] for probe in probes}
    for round_index in range(args.rounds):
        for kind, interval in probes[round_index % len(probes):] + probes[: round_index % len(probes)]:
            sys.setswitchinterval(interval)
            with Beside(worker, kind, tokens, args.job_tokens):
                times[(kind, interval)].append(decode_steps_ms(worker, tokens, args.steps))
    sys.setswitchinterval(default_interval)
    rows = []
    for kind, interval in probes:
        alone = times[("nothing", interval)]
        ratios = [beside / by_itself for beside, by_itself in zip(times[(kind, interval)], alone)]
        rows.append({"beside": kind, "switch_interval_ms": interval * 1000,
                     "decode_step_ms": round(statistics.median(times[(kind, interval)]), 2),
                     "vs_alone": round(statistics.median(ratios), 3)})
    print(machine_line())
    print(markdown_table(list(rows[0]), [list(row.values()) for row in rows]))
    if args.json:
        write_json(args.json, {"args": vars(args), "rows": rows, "times": {f"{kind}@{interval}": values
                                                                            for (kind, interval), values in
                                                                            times.items()}})


if __name__ == "__main__":
    main()
