"""Why the service decodes slower with TORCH_THREADS=2 than with 1 on a 2-core machine (issue 17): decode
steps of one conversation run in the main thread or in another thread, the way the service's model thread
runs them, with the main thread having opened an OpenMP team of its own (loading the model with the same
threads) or not (loading it with one).

    python -m benchmarks.thread_placement --threads 2

Each scenario runs in a fresh process (OpenMP's thread pools live as long as the process): the bundled model
with the default weights (int4-g32-int8head), a 900-token random prompt prefilled, then --steps greedy decode
steps with a DynamicCache; the median step is printed."""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import torch

from benchmarks.harness import MODEL_CACHE, StreamedTable
from benchmarks.harness.child import child_result
from statekeeper.model_loader import load_model, with_weights

SCENARIOS = {
    "main": "decode in the main thread, which loaded the model with --threads",
    "other": "decode in another thread; the main thread loaded the model with --threads (its own team)",
    "other-main-at-1": "decode in another thread at --threads; the main thread loaded the model with 1 thread",
    "other-loaded-in-ended-thread": "decode in another thread at --threads; the model was loaded at --threads in "
                                    "a thread that ended before (the main thread stays at 1)",
}


def decode_ms(model, steps: int) -> float:
    ids = torch.randint(0, 40000, (1, 900), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        from transformers import DynamicCache
        cache = DynamicCache()
        token = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def run_scenario(name: str, threads: int, steps: int, model_cache: Path) -> float:
    torch.set_num_threads(1 if name.startswith("other-") and name != "other" else threads)
    if name == "other-loaded-in-ended-thread":
        loaded = []

        def load():
            torch.get_num_threads()
            torch.set_num_threads(threads)
            loaded.append(with_weights(load_model("smollm2", model_cache), "int4-g32-int8head").model)

        loader = threading.Thread(target=load)
        loader.start()
        loader.join()
        model = loaded[0]
    else:
        model = with_weights(load_model("smollm2", model_cache), "int4-g32-int8head").model
    if name == "main":
        return decode_ms(model, steps)
    result = []

    def in_thread():
        torch.get_num_threads()  # adopt the process-wide count first, or the first op would reset the thread's
        torch.set_num_threads(threads)
        result.append(decode_ms(model, steps))

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join()
    return result[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--model-cache", type=Path, default=MODEL_CACHE)
    parser.add_argument("--scenario", choices=SCENARIOS, help="run one scenario here (the driver's child)")
    args = parser.parse_args()
    if args.scenario:
        print(json.dumps({"ms": run_scenario(args.scenario, args.threads, args.steps, args.model_cache)}))
        return
    table = StreamedTable(["scenario", "threads", f"decode ms/step (median of {args.steps})"])
    for name, what in SCENARIOS.items():
        result = child_result("benchmarks.thread_placement", ["--scenario", name, "--threads", str(args.threads),
                                                              "--steps", str(args.steps), "--model-cache",
                                                              str(args.model_cache)])
        table.row([f"{name}: {what}", args.threads, f"{result['ms']:.1f}"])


if __name__ == "__main__":
    main()
