"""`statekeeper simulate`: a trace (a JSON-lines file, or a synthetic day) through the placement simulator, with
the tiers' budgets and a cost profile given; prints where the resumed turns found their KV, how many tokens were
recomputed, the estimated first tokens and what compression cost."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from statekeeper.placement.costs import CostProfile
from statekeeper.placement.trace import read
from statekeeper.simulation.simulator import (COMPRESSIONS, POLICIES, SimulationConfig, SimulationReport,
                                              service_compression, simulate)
from statekeeper.simulation.synthetic import SyntheticTrace, synthetic

UNITS = {"": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
         "TIB": 2**40}
PROFILES = Path(__file__).parent / "profiles"
DEFAULT_PROFILE = PROFILES / "smollm2-135m-xeon-1thread.json"


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


def parse_profile(text: str) -> CostProfile:
    """A cost profile's path, or the name of one shipped in statekeeper/simulation/profiles/."""
    path = Path(text)
    if not path.exists() and (PROFILES / f"{text}.json").exists():
        path = PROFILES / f"{text}.json"
    try:
        return CostProfile.load(path)
    except FileNotFoundError:
        shipped = ", ".join(sorted(p.stem for p in PROFILES.glob("*.json")))
        raise argparse.ArgumentTypeError(f"no cost profile {text!r} (shipped: {shipped})") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"unreadable cost profile {text!r}: {exc}") from None


def add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, help="JSON lines of turns (time_s, conversation, prompt_tokens, "
                                                   "reply_tokens, tenant); without it, a synthetic day")
    parser.add_argument("--tenants", type=int, default=1, help="the synthetic day's tenants (see trace.py)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", type=parse_profile, default=str(DEFAULT_PROFILE),
                        help="a cost profile file or a shipped profile's name")
    parser.add_argument("--idle-offload", type=float, default=300.0, help="IDLE_OFFLOAD_SECONDS")


def check_tiers(parser: argparse.ArgumentParser, tiers: list[tuple[str, int]], profile: CostProfile) -> None:
    unknown = [name for name, _ in tiers if name not in profile.tiers]
    if unknown:
        parser.error(f"the profile has no read costs for tier(s) {', '.join(unknown)} "
                     f"(it has {', '.join(profile.tiers)})")


def print_report(report: SimulationReport) -> None:
    resumed = sum(report.resumed.values())
    print(f"{report.turns} turns, {resumed} resumed, simulated in {report.seconds:.1f} s")
    for source, count in report.resumed.most_common():
        print(f"  {source}: {count} turns ({count / max(resumed, 1):.1%}), {report.history_tokens[source]} history tokens")
    print(f"recomputed tokens: {report.recomputed_tokens}; first token p50 {report.first_token_percentile(0.5):.0f} ms, "
          f"p95 {report.first_token_percentile(0.95):.0f} ms (estimated); demotions {report.demotions}, "
          f"evictions {report.evictions}")
    print(f"compressed {report.compressed} blobs ({report.compress_cancelled} cancelled), compression CPU "
          f"{report.compress_cpu_s:.0f} s ({report.compress_wasted_cpu_s:.0f} s wasted), backlog at the end "
          f"{report.compress_backlog_end}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="statekeeper simulate", description=__doc__)
    add_trace_arguments(parser)
    parser.add_argument("--conversations", type=int, default=10_000, help="the synthetic day's conversations")
    parser.add_argument("--tiers", type=parse_tiers, required=True, help="NAME=SIZE,... fastest first")
    parser.add_argument("--policy", choices=POLICIES, default="value")
    parser.add_argument("--compression", choices=COMPRESSIONS, help="default: the policy's own (value), or "
                                                                    "scheduled with LRU")
    parser.add_argument("--compress-after", type=float, default=600.0, help="COMPRESS_AFTER_SECONDS (scheduled)")
    parser.add_argument("--compress-workers", type=int, help="cores compressing (default: the profile's)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    check_tiers(parser, args.tiers, args.profile)
    profile = args.profile if args.compress_workers is None else args.profile.with_workers(args.compress_workers)
    compression = args.compression or service_compression(args.policy)
    turns = (list(read(args.trace)) if args.trace
             else synthetic(SyntheticTrace(args.conversations, tenants=args.tenants, seed=args.seed)))
    try:
        config = SimulationConfig(args.tiers, profile, args.idle_offload, args.policy, compression, args.compress_after)
    except ValueError as exc:
        parser.error(str(exc))
    report = simulate(turns, config)
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report.as_dict()))


if __name__ == "__main__":
    main()
