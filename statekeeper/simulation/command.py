"""`statekeeper simulate`: a trace (a JSON-lines file, or a synthetic day) through the placement simulator, with
the tiers' budgets given; prints where the resumed turns found their KV and how many tokens were recomputed."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from statekeeper.simulation.simulator import SimulationConfig, simulate
from statekeeper.simulation.trace import SyntheticTrace, read, synthetic

UNITS = {"": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
         "TIB": 2**40}


def parse_bytes(text: str) -> int:
    """`512MiB`, `2GB`, `1.5TB`, `1000` (bytes)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([A-Za-z]*)", text.strip())
    unit = match and match.group(2).upper()
    unit = unit if unit in UNITS else f"{unit}B" if f"{unit}B" in UNITS else None
    if match is None or unit is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GB, 1000)")
    return int(float(match.group(1)) * UNITS[unit])


def parse_tiers(text: str) -> list[tuple[str, int]]:
    """`dram=2GiB,ssd=100GiB`: fastest first."""
    tiers = []
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not name or not size:
            raise argparse.ArgumentTypeError(f"a tier is NAME=SIZE, not {part!r}")
        tiers.append((name.strip(), parse_bytes(size.strip())))
    return tiers


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="statekeeper simulate", description=__doc__)
    parser.add_argument("--trace", type=Path, help="JSON lines of turns (time_s, conversation, prompt_tokens, "
                                                   "reply_tokens); without it, a synthetic day")
    parser.add_argument("--conversations", type=int, default=10_000, help="the synthetic day's conversations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiers", type=parse_tiers, required=True, help="NAME=SIZE,... fastest first")
    parser.add_argument("--bytes-per-token", type=int, required=True,
                        help="stored KV bytes a token (SmolLM2-135M in bfloat16: 2 x 30 layers x 3 heads x 64 x 2)")
    parser.add_argument("--idle-offload", type=float, default=300.0, help="IDLE_OFFLOAD_SECONDS")
    parser.add_argument("--compress-after", type=float, help="COMPRESS_AFTER_SECONDS (unset: blobs stay exact)")
    parser.add_argument("--compression-ratio", type=float, default=8.0, help="exact bytes over compressed")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    turns = list(read(args.trace)) if args.trace else synthetic(SyntheticTrace(args.conversations, seed=args.seed))
    report = simulate(turns, SimulationConfig(args.tiers, args.bytes_per_token, args.idle_offload,
                                              args.compress_after, args.compression_ratio))
    resumed = sum(report.resumed.values())
    print(f"{report.turns} turns, {resumed} resumed, simulated in {report.seconds:.1f} s")
    for source, count in report.resumed.most_common():
        print(f"  {source}: {count} turns ({count / max(resumed, 1):.1%}), {report.history_tokens[source]} history tokens")
    print(f"recomputed tokens: {report.recomputed_tokens}; demotions {report.demotions}, evictions {report.evictions}, "
          f"compressed {report.compressed}")
    if args.json:
        args.json.write_text(json.dumps(report.as_dict()))


if __name__ == "__main__":
    main()
