"""Where a GPU restore's host time goes (issue 34): torch.profiler over a few compressed and exact restores
of a 16k-token SmolLM2-shaped state, the ops by host time, and the cost of the small pinned copies a
decode makes. `python -m benchmarks.gpu_restore_profile [--tokens 16384]` where a GPU is."""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.gpu_restore import TOKENS, _compressed_blob, random_worker
from statekeeper.device_restore import DeviceRestorer, PinnedRing


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--shape", default="smollm2-135m")
    args = parser.parse_args(argv)
    data = json.loads(TOKENS.read_text())
    history, message = data["history"][: args.tokens], data["messages"][0]
    worker = random_worker(args.shape, "cuda", 4096)
    tensors, form, _ = _compressed_blob(worker, history, message)
    cache = worker.new_cache()
    worker.prefill(cache, history)
    pinned = [(k.cpu().pin_memory(), v.cpu().pin_memory()) for k, v in cache.export_layers()]
    ring = PinnedRing.for_copies([k.nbytes for k, _ in pinned] * 2, pinned=True)
    restorers = {"compressed 4 groups thread": DeviceRestorer(worker, ring),
                 "compressed 1 group inline": DeviceRestorer(worker, ring, compressed_groups=1, copier="inline")}
    runs = {name: (lambda r=r: r.restore_compressed(tensors, form, history, message)) for name, r in restorers.items()}
    inline = DeviceRestorer(worker, ring, copier="inline")
    runs["exact inline"] = lambda: inline.restore_exact(pinned, history, message)
    runs["hot"] = lambda: (cache.set_length(len(history)), worker.prefill(cache, message))
    for name, run in runs.items():
        for _ in range(2):
            run()
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(3):
            run()
        host = (time.perf_counter() - started) / 3 * 1e3
        torch.cuda.synchronize()
        print(f"{name}: {host:.2f} ms host per restore")
    small = []
    for _ in range(50):
        started = time.perf_counter()
        torch.tensor([1, 2, 3]).pin_memory().to("cuda", non_blocking=True)
        small.append((time.perf_counter() - started) * 1e6)
    print(f"a small pinned copy: median {sorted(small)[25]:.1f} us, max {max(small):.1f} us")
    from torch.profiler import ProfilerActivity, profile

    for name in ("compressed 1 group inline", "exact inline"):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                runs[name]()
            torch.cuda.synchronize()
        print(f"\n{name}: ops by host time (3 restores)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))


if __name__ == "__main__":
    main()
