"""`statekeeper plan`: how many conversations a tier mix keeps warm, and what to add to reach a target.

    statekeeper plan --conversations-per-day 1000000 --profile llama-3.1-8b-h100-nvme \\
        --tiers dram=256GiB,ssd=4TB --tiers dram=512GiB,ssd=8TB --target-hit-rate 0.9

For each tier mix, a day of that many conversations (the synthetic day, statekeeper/simulation/synthetic.py, or
--trace, e.g. the service's own TRACE_FILE) runs through the simulator with the placement policy and the cost
profile's restore, recompute and compression costs. A day larger than --sample-conversations is simulated on
that many conversations with every tier and the compression cores scaled down alike: conversations do not
share state, so a tier's share of the day is what decides what it keeps. Printed per mix: the hit rate
(resumed turns that found their KV in memory or a tier), where they found it, the estimated first token
(p50/p95) of resumed turns, the recompute load (history tokens a day, and the compute time they take on the
profile's hardware) and the compression CPU; then, if the mix misses --target-hit-rate, the smallest multiple
of its last (largest) tier that reaches it."""

from __future__ import annotations

import argparse
import dataclasses
import random

from statekeeper.placement.costs import CostProfile
from statekeeper.placement.trace import TraceTurn, read
from statekeeper.simulation.command import add_trace_arguments, check_tiers, parse_tiers
from statekeeper.simulation.simulator import (POLICIES, SimulationConfig, SimulationReport, hit_rate,
                                              service_compression, simulate)
from statekeeper.simulation.synthetic import SyntheticTrace, synthetic

GROWTH = (2, 4, 8, 16, 32, 64)  # multiples of the last tier tried against the target


@dataclasses.dataclass(frozen=True, slots=True)
class Forecast:
    tiers: list[tuple[str, int]]  # as asked, for the whole day
    report: SimulationReport
    recompute_s: float  # the day's recomputes on the profile's hardware, scaled back to the whole day
    compress_cpu_s: float  # the day's compression CPU, and how much of it was wasted, likewise
    compress_wasted_cpu_s: float
    scale: float  # the whole day's conversations over the simulated ones
    days: int = 1  # the days the simulated turns span (a trace of several): the totals above are per day

    @property
    def hit_rate(self) -> float:
        rate = hit_rate(self.report.resumed)
        return 1.0 if rate is None else rate  # no resumed turn: none missed


def sample_trace(turns: list[TraceTurn], keep: int, seed: int) -> list[TraceTurn]:
    """The turns of `keep` of the trace's conversations, drawn at random."""
    conversations = sorted({turn.conversation for turn in turns})
    if len(conversations) <= keep:
        return turns
    kept = set(random.Random(seed).sample(conversations, keep))
    return [turn for turn in turns if turn.conversation in kept]


def forecast(turns: list[TraceTurn], scale: float, tiers: list[tuple[str, int]], profile: CostProfile, policy: str,
             idle_offload_s: float, days: int = 1) -> Forecast:
    """`turns`: the simulated share of `days` days, each `scale` times larger; `tiers`: the whole day's
    budgets."""
    scaled_tiers = [(name, max(1, int(budget / scale))) for name, budget in tiers]
    cores = scaled_compression(profile, scale)
    config = SimulationConfig(scaled_tiers, cores, idle_offload_s, policy, service_compression(policy))
    report = simulate(turns, config)
    cpu = scale * profile.compress_ms_linear / max(1e-12, cores.compress_ms_linear)  # a slowed core's seconds
    return Forecast(tiers, report, report.recompute_ms / 1e3 * scale / days, report.compress_cpu_s * cpu / days,
                    report.compress_wasted_cpu_s * cpu / days, scale, days)


def scaled_compression(profile: CostProfile, scale: float) -> CostProfile:
    """The profile's compression cores (the whole deployment's) for 1/scale of its traffic: fewer cores, or,
    below one, one core that much slower."""
    share = profile.compress_workers / scale
    workers = max(1, int(share))
    slower = workers / share
    return dataclasses.replace(profile, compress_workers=workers, compress_ms_linear=profile.compress_ms_linear * slower,
                               compress_ms_quadratic=profile.compress_ms_quadratic * slower)


def reaching(target: float, turns, scale, tiers, profile, policy, idle_offload_s) -> tuple[int, Forecast] | None:
    """The smallest multiple in GROWTH of the last tier whose mix reaches `target`, with its forecast."""
    name, budget = tiers[-1]
    for multiple in GROWTH:
        grown = tiers[:-1] + [(name, budget * multiple)]
        result = forecast(turns, scale, grown, profile, policy, idle_offload_s)
        if result.hit_rate >= target:
            return multiple, result
    return None


def conversations_kept_warm(target: float, tiers, profile: CostProfile, policy: str, idle_offload_s: float,
                            sample: int, tenants: int, seed: int, low: int = 1_000, high: int = 1_000_000_000
                            ) -> int | None:
    """The most conversations a day (within a factor of 1.1) at which `tiers` still give `target` hit rate:
    one simulated day of `sample` conversations, its budgets scaled to each day size tried (None: not even
    `low`)."""
    turns = synthetic(SyntheticTrace(sample, tenants=tenants, seed=seed))

    def reaches(conversations: int) -> bool:
        scale = conversations / sample
        return forecast(turns, scale, tiers, profile, policy, idle_offload_s).hit_rate >= target

    if not reaches(low):
        return None
    while high / low > 1.1:
        middle = round((low * high) ** 0.5)
        low, high = (middle, high) if reaches(middle) else (low, middle)
    return low


def _size(num_bytes: float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if num_bytes >= size:
            return f"{num_bytes / size:.3g} {unit}"
    return f"{num_bytes:.0f} B"


def describe(result: Forecast) -> str:
    report = result.report
    resumed = sum(report.resumed.values())
    shares = ", ".join(f"{source} {count / max(1, resumed):.1%}" for source, count in report.resumed.most_common())
    recomputed = report.recomputed_tokens * result.scale / result.days
    return (f"  hit rate {result.hit_rate:.1%} ({shares})\n"
            f"  first token of resumed turns (estimated): p50 {report.first_token_percentile(0.5):.0f} ms, "
            f"p95 {report.first_token_percentile(0.95):.0f} ms\n"
            f"  recompute load: {recomputed:,.0f} history tokens a day, {result.recompute_s / 3600:,.1f} compute-hours\n"
            f"  compression: {result.compress_cpu_s / 3600:,.1f} CPU-hours a day "
            f"({result.compress_wasted_cpu_s / 3600:,.1f} wasted)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="statekeeper plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_trace_arguments(parser)
    parser.add_argument("--conversations-per-day", type=int,
                        help="the day to forecast (without it, --target-hit-rate: how many each mix keeps warm)")
    parser.add_argument("--tiers", type=parse_tiers, action="append", required=True,
                        help="NAME=SIZE,... fastest first, for the whole day's traffic; repeat to compare mixes")
    parser.add_argument("--policy", choices=POLICIES, default="value")
    parser.add_argument("--target-hit-rate", type=float)
    parser.add_argument("--sample-conversations", type=int, default=20_000)
    args = parser.parse_args(argv)
    for tiers in args.tiers:
        check_tiers(parser, tiers, args.profile)
    if args.conversations_per_day is None:
        if args.target_hit_rate is None or args.trace:
            parser.error("without --conversations-per-day, give --target-hit-rate (on the synthetic day)")
        for tiers in args.tiers:
            most = conversations_kept_warm(args.target_hit_rate, tiers, args.profile, args.policy, args.idle_offload,
                                           args.sample_conversations, args.tenants, args.seed)
            mix = ", ".join(f"{name} {_size(budget)}" for name, budget in tiers)
            print(f"{mix}: " + ("below the target even at 1,000 conversations a day" if most is None else
                                f"keeps {args.target_hit_rate:.0%} of resumed turns warm up to ~{most:,} "
                                f"conversations a day"))
        return
    if args.conversations_per_day < 1 or args.sample_conversations < 1:
        parser.error("--conversations-per-day and --sample-conversations must be >= 1")
    if args.target_hit_rate is not None and not 0 < args.target_hit_rate <= 1:
        parser.error("--target-hit-rate is a share in (0, 1]")
    days = 1
    if args.trace:
        # TRACE_FILE grows day after day: its conversations are so many days' (the budgets serve one day's)
        turns = list(read(args.trace))
        times = [turn.time_s for turn in turns]
        days = max(1, round((max(times, default=0.0) - min(times, default=0.0)) / 86_400))
        found = len({turn.conversation for turn in turns})
        simulated = min(args.conversations_per_day * days, args.sample_conversations)
        turns = sample_trace(turns, simulated, args.seed)
        simulated = len({turn.conversation for turn in turns})
        print(f"trace {args.trace}: {found:,} conversations over {days} day{'s' if days > 1 else ''}, "
              f"{simulated:,} simulated for days of {args.conversations_per_day:,}")
    else:
        simulated = min(args.conversations_per_day, args.sample_conversations)
        turns = synthetic(SyntheticTrace(simulated, tenants=args.tenants, seed=args.seed))
    if not turns:
        parser.error("the trace holds no turns")
    scale = args.conversations_per_day * days / simulated
    profile = args.profile
    print(f"profile: {profile.name or '(unnamed)'}; {profile.bytes_per_token:,} bytes a token exact, "
          f"{profile.compression_ratio:g}x compressed; policy {args.policy}; "
          f"{simulated:,} of {args.conversations_per_day * days:,} conversations simulated "
          f"(1/{scale:.3g} of every budget)")
    for tiers in args.tiers:
        result = forecast(turns, scale, tiers, profile, args.policy, args.idle_offload, days)
        print("\n" + ", ".join(f"{name} {_size(budget)}" for name, budget in tiers) + ":")
        print(describe(result))
        if args.target_hit_rate is not None and result.hit_rate < args.target_hit_rate:
            found = reaching(args.target_hit_rate, turns, scale, tiers, profile, args.policy, args.idle_offload)
            name, budget = tiers[-1]
            if found is None:
                print(f"  to reach {args.target_hit_rate:.0%}: more than {GROWTH[-1]}x {name} "
                      f"({_size(budget * GROWTH[-1])}) is needed")
            else:
                multiple, grown = found
                print(f"  to reach {args.target_hit_rate:.0%}: {name} {_size(budget * multiple)} ({multiple}x) "
                      f"gives {grown.hit_rate:.1%}")


if __name__ == "__main__":
    main()
