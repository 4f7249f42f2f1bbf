"""Where a day of conversations finds its KV, by placement policy (issue 32), on the placement simulator
(`statekeeper simulate`: the service's own tier manager and policy over size-only tiers, statekeeper/simulation/).

    python -m benchmarks.placement --conversations 10000,100000 --json placement.json

The heavy-tailed synthetic day (statekeeper/simulation/trace.py, its stated parameters) at each size, with tiers
that hold --capacity-share of the bytes the day's conversations reach at their last turn (exact), split
--dram-share to DRAM and the rest to SSD. Policies, side by side on the same trace and tiers:
    lru-exact      LRU, blobs stay exact (what LMCache does by default)
    lru-scheduled  LRU, blobs compressed COMPRESS_AFTER_SECONDS after their offload (today's default)
Per policy: resumed turns by where their KV came from, recomputed history tokens, and the ratio of recomputed
tokens to lru-exact's. Bytes a token: SmolLM2-135M's KV in bfloat16 (2 × 30 layers × 3 heads × 64 × 2 bytes)."""

from __future__ import annotations

import argparse

from benchmarks.harness import machine_line, markdown_table, write_json
from statekeeper.simulation.simulator import ACTIVE, RECOMPUTE, SimulationConfig, simulate
from statekeeper.simulation.trace import SyntheticTrace, synthetic

BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 2
POLICIES = ("lru-exact", "lru-scheduled")


def final_bytes(turns) -> int:
    tokens = {}
    for turn in turns:
        tokens[turn.conversation] = tokens.get(turn.conversation, 0) + turn.prompt_tokens + turn.reply_tokens
    return sum(tokens.values()) * BYTES_PER_TOKEN


def run(conversations: int, args: argparse.Namespace) -> list[dict]:
    turns = synthetic(SyntheticTrace(conversations, seed=args.seed))
    capacity = final_bytes(turns) * args.capacity_share
    tiers = [("dram", int(capacity * args.dram_share)), ("ssd", int(capacity * (1 - args.dram_share)))]
    rows = []
    for policy in POLICIES:
        compress_after = args.compress_after if policy == "lru-scheduled" else None
        report = simulate(turns, SimulationConfig(tiers, BYTES_PER_TOKEN, args.idle_offload, compress_after))
        rows.append({"conversations": conversations, "policy": policy, "tiers": dict(tiers)} | report.as_dict())
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", default="10000,100000")
    parser.add_argument("--capacity-share", type=float, default=0.2)
    parser.add_argument("--dram-share", type=float, default=0.1, help="of the tiers' bytes")
    parser.add_argument("--idle-offload", type=float, default=300.0)
    parser.add_argument("--compress-after", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args()
    print(machine_line())
    rows = [row for count in args.conversations.split(",") for row in run(int(count), args)]
    table = []
    for row in rows:
        resumed = sum(row["resumed"].values())
        exact = next(r for r in rows if r["conversations"] == row["conversations"] and r["policy"] == "lru-exact")
        share = {source: row["resumed"].get(source, 0) / resumed for source in (ACTIVE, "dram", "ssd", RECOMPUTE)}
        table.append([f"{row['conversations']:,}", row["policy"], f"{resumed:,}",
                      " / ".join(f"{share[s]:.3f}" for s in share), f"{row['recomputed_tokens']:,}",
                      f"{row['recomputed_tokens'] / exact['recomputed_tokens']:.3f}", f"{row['compressed']:,}",
                      f"{row['seconds']:.1f}"])
    print(markdown_table(["conversations", "policy", "resumed turns", "share active / dram / ssd / recompute",
                          "recomputed tokens", "÷ lru-exact", "compressed", "simulated in s"], table))
    if args.json:
        write_json(args.json, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
