"""Where a day of conversations finds its KV, by placement policy (issue 32), on the placement simulator
(`statekeeper simulate`: the service's own tier manager and policies over size-only tiers, statekeeper/simulation/).

    python -m benchmarks.placement --conversations 10000,100000,1000000 --json placement.json

The heavy-tailed synthetic day (statekeeper/simulation/synthetic.py, its stated parameters; --tenants splits it
into tenants whose users stay away for different times) at each size, with tiers that hold
--capacity-conversations of the day's conversations in their compressed form at their last turn, split
--dram-share to DRAM and the rest to LMDB (the service's default tiers). Costs: --profile (default: the one
measured on this machine, statekeeper/simulation/profiles/). Compression runs on one core per
--conversations-per-worker conversations of the day (the profile's measured CPU time a blob; a service this
size is that many machines, each with its one compression process). Policies, side by side on the same trace,
tiers and cores:
    lru-exact      LRU, blobs stay exact (what LMCache does by default)
    lru-scheduled  LRU, blobs compressed COMPRESS_AFTER_SECONDS after their offload or when DRAM is full
                   (today's default, sessions/offload.py's Compactor)
    value          the expected-value policy (statekeeper/placement/): eviction and compression by expected
                   returns, costs and bytes
Per policy: resumed turns by where their KV came from, recomputed history tokens and their ratios, the
estimated first token of resumed turns (p50/p95), and the compression CPU spent and wasted."""

from __future__ import annotations

import argparse

from benchmarks.harness import machine_line, markdown_table, write_json
from statekeeper.simulation.command import DEFAULT_PROFILE, parse_profile
from statekeeper.simulation.simulator import ACTIVE, RECOMPUTE, SimulationConfig, simulate
from statekeeper.simulation.synthetic import SyntheticTrace, synthetic

POLICIES = {"lru-exact": ("lru", "none"), "lru-scheduled": ("lru", "scheduled"), "value": ("value", "value")}
TIERS = ("dram", "lmdb")


def final_tokens(turns) -> int:
    tokens = {}
    for turn in turns:
        tokens[turn.conversation] = tokens.get(turn.conversation, 0) + turn.prompt_tokens + turn.reply_tokens
    return sum(tokens.values())


def run(conversations: int, args: argparse.Namespace) -> list[dict]:
    turns = synthetic(SyntheticTrace(conversations, tenants=args.tenants, seed=args.seed))
    profile = args.profile
    capacity = final_tokens(turns) * profile.bytes_per_token / profile.compression_ratio * args.capacity_conversations
    tiers = [(TIERS[0], int(capacity * args.dram_share)), (TIERS[1], int(capacity * (1 - args.dram_share)))]
    workers = max(1, round(conversations / args.conversations_per_worker))
    rows = []
    for name in args.policies.split(","):
        policy, compression = POLICIES[name]
        config = SimulationConfig(tiers, profile.with_workers(workers), args.idle_offload, policy, compression,
                                  args.compress_after)
        report = simulate(turns, config)
        row = {"conversations": conversations, "policy": name, "tenants": args.tenants, "workers": workers,
               "tiers": dict(tiers)} | report.as_dict()
        if not args.keep_series:
            del row["tier_bytes_over_time"]
        rows.append(row)
        print(f"{conversations:,} {name}: {report.recomputed_tokens:,} recomputed tokens, "
              f"simulated in {report.seconds:.0f} s", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = []
    for row in rows:
        same = [r for r in rows if r["conversations"] == row["conversations"]]
        by_policy = {r["policy"]: r["recomputed_tokens"] for r in same}
        resumed = sum(row["resumed"].values())
        share = [row["resumed"].get(source, 0) / resumed for source in (ACTIVE, *TIERS, RECOMPUTE)]
        ratios = [f"{row['recomputed_tokens'] / by_policy[p]:.3f}" if by_policy.get(p) else "-"
                  for p in ("lru-exact", "lru-scheduled")]
        lines.append([f"{row['conversations']:,}", row["policy"], row["workers"], f"{resumed:,}",
                      " / ".join(f"{s:.3f}" for s in share), f"{row['recomputed_tokens']:,}", *ratios,
                      f"{row['first_token_ms_p50']:.0f} / {row['first_token_ms_p95']:.0f}",
                      f"{row['compressed']:,}", f"{row['compress_cpu_s']:,.0f} ({row['compress_wasted_cpu_s']:,.0f})",
                      f"{row['seconds']:.0f}"])
    return markdown_table(["conversations", "policy", "compress cores", "resumed turns",
                           "share active / dram / lmdb / recompute", "recomputed tokens", "÷ lru-exact",
                           "÷ lru-scheduled", "first token ms p50 / p95 (est.)", "compressed",
                           "compress CPU s (wasted)", "simulated in s"], lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", default="10000,100000")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--capacity-conversations", type=float, default=0.2,
                        help="share of the day's conversations the tiers hold, compressed")
    parser.add_argument("--dram-share", type=float, default=0.1, help="of the tiers' bytes")
    parser.add_argument("--conversations-per-worker", type=float, default=10_000)
    parser.add_argument("--tenants", type=int, default=1)
    parser.add_argument("--profile", type=parse_profile, default=str(DEFAULT_PROFILE))
    parser.add_argument("--idle-offload", type=float, default=300.0)
    parser.add_argument("--compress-after", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-series", action="store_true", help="bytes per tier over time in the JSON")
    parser.add_argument("--json")
    args = parser.parse_args()
    unknown = set(args.policies.split(",")) - set(POLICIES)
    if unknown:
        parser.error(f"unknown policies {sorted(unknown)}; known: {', '.join(POLICIES)}")
    print(machine_line())
    rows = [row for count in args.conversations.split(",") for row in run(int(count), args)]
    print(table(rows))
    if args.json:
        write_json(args.json, {"args": vars(args) | {"profile": args.profile.name}, "rows": rows})


if __name__ == "__main__":
    main()
