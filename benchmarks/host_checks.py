"""The host's checks of a compressed blob before a GPU restore queues anything (issue 34:
compression/layer_decode.py `check_layers`): milliseconds on this machine's CPU, which is what a GPU
restore pays on its host before its copies start, for the default stored layout at the given lengths, beside
the same function from another checkout (`--baseline-repo`, e.g. a worktree of an earlier commit), the two
interleaved in every repeat. Runs on a CPU: the checks never touch the device.

    python -m benchmarks.host_checks --baseline-repo /tmp/wt --lengths 4096,16384 --json OUT
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.gpu_restore import _compressed_blob, random_worker
from benchmarks.harness.results import machine_record, write_json
from benchmarks.harness.tables import markdown_table
from statekeeper.compression import layer_decode


def _module_from(repo: Path):
    """`statekeeper/compression/layer_decode.py` of another checkout, loaded beside this one's."""
    spec = importlib.util.spec_from_file_location("baseline_layer_decode",
                                                  repo / "statekeeper/compression/layer_decode.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--lengths", default="4096,16384")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--baseline-repo", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    versions = {"this checkout": layer_decode}
    if args.baseline_repo:
        versions["baseline"] = _module_from(args.baseline_repo)
    worker = random_worker(args.shape, "cpu", 4096)
    generator = torch.Generator().manual_seed(0)
    results, rows = {"command": " ".join(sys.argv), "shape": args.shape, "lengths": []}, []
    for n in (int(x) for x in args.lengths.split(",")):
        history = torch.randint(100, 40000, (n,), generator=generator).tolist()
        message = torch.randint(100, 40000, (48,), generator=generator).tolist()
        tensors, form, _ = _compressed_blob(worker, history, message)
        shape = (tensors, form, worker.num_layers, worker.num_kv_heads)
        counts = {name: [c.rows for c in module.check_layers(*shape)] for name, module in versions.items()}
        if len({tuple(c) for c in counts.values()}) != 1:
            sys.exit("the versions disagree on the blob's row counts")
        times = {name: [] for name in versions}
        for _ in range(args.repeats):
            for name, module in versions.items():
                started = time.perf_counter()
                module.check_layers(*shape)
                times[name].append((time.perf_counter() - started) * 1e3)
        medians = {name: round(statistics.median(values), 3) for name, values in times.items()}
        results["lengths"].append({"tokens": n, "ms": medians})
        rows.append([n] + [medians[name] for name in versions]
                    + ([round(medians["this checkout"] / medians["baseline"], 3)] if "baseline" in medians else []))
    machine = machine_record()
    print(f"check_layers on {machine['line']}, ms (median of {args.repeats}):")
    print(markdown_table(["tokens"] + list(versions) + (["ratio"] if args.baseline_repo else []), rows))
    if args.json:
        write_json(args.json, results, machine)


if __name__ == "__main__":
    main()
