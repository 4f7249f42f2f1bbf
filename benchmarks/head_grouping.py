"""What grouping heads would cost over statekeeper's per-head ragged storage (issue 5, TANGRAM §4.2).

TANGRAM pages the KV of H_p heads together so a paged attention kernel reads them with one page table;
a group is padded to its longest head. statekeeper stores each head at its own length (H_p = 1, rows
back to back) because a stored state is only ever scattered back into a dense cache, never read by a
paged kernel. This measures the padding grouping would add, on real per-head token counts:
- adaptive (Ada-KV) budgets from kvzip scores on ShareGPT histories (`kvzip@keep`), and
- calibrated budgets from a head profile (`statekeeper calibrate`), which are the same for every
  history of a length,
for groups of H_p = 1 and H_p = all KV heads of a layer, with pages of 1 token (ragged) and 16 tokens.

    python -m benchmarks.head_grouping --threads 2 --profile heads-...-kvzip.json
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

from benchmarks.harness import StreamedTable, add_model_arguments, load_worker
from statekeeper.chat import ChatFormatter
from statekeeper.compression import by_name
from statekeeper.compression.head_profile import HeadProfile
from statekeeper.evaluation.datasets import sharegpt_conversations
from statekeeper.evaluation.teacher_forcing import build_state, sharegpt_cases


def padded_entries(counts: list[list[int]], group: int, page: int) -> int:
    """(head, token) slots allocated when each group of `group` heads is padded to its longest head and
    every head's tokens fill whole pages of `page` tokens."""
    total = 0
    for layer in counts:
        for start in range(0, len(layer), group):
            heads = layer[start : start + group]
            total += len(heads) * math.ceil(max(heads) / page) * page
    return total


def overheads(counts: list[list[int]]) -> dict[tuple[int, int], float]:
    kept = sum(map(sum, counts))
    heads = len(counts[0])
    return {(group, page): padded_entries(counts, group, page) / kept - 1 for group in (1, heads) for page in (1, 16)}


def main() -> None:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser, threads=2)
    parser.add_argument("--lengths", default="1000,2000")
    parser.add_argument("--conversations", type=int, default=10)
    parser.add_argument("--keeps", default="0.5,0.25")
    parser.add_argument("--profile", required=True)
    args = parser.parse_args()
    worker = load_worker(args)
    profile = HeadProfile.from_json(Path(args.profile).read_text())
    profile.check(worker.num_layers, worker.num_kv_heads)
    formatter = ChatFormatter(worker.tokenizer)
    keeps = [float(k) for k in args.keeps.split(",")]
    table = StreamedTable(["history", "budgets", "keep", "padding H_p=1, ragged", "H_p=1, 16-token pages",
                           "H_p=all, ragged", "H_p=all, 16-token pages"])
    for length in [int(x) for x in args.lengths.split(",")]:
        cases = sharegpt_cases(formatter, sharegpt_conversations(min_turns=4), length, args.conversations,
                               worker.tokenizer.eos_token_id)
        adaptive = {keep: [] for keep in keeps}
        calibrated = {keep: [] for keep in keeps}
        for index, case in enumerate(cases):
            history = case.history[:-1]
            state = build_state(worker, history)
            state.stats.reconstruction = worker.reconstruction_scores(state.cache, history)
            for keep in keeps:
                compressed = by_name(f"kvzip@{keep}").compress(state.cache.export_layers(), state.stats)
                stored = dict(compressed.tensors)
                counts = [stored[f"{i}.counts"].tolist() for i in range(worker.num_layers)]
                adaptive[keep].append(overheads(counts))
                budget = profile.budget_for(keep)
                if budget is not None:
                    n = len(history)
                    calibrated[keep].append(overheads([[min(n, math.ceil(b * n)) for b in layer] for layer in budget]))
            print(f"length {length}: conversation {index + 1}/{len(cases)}", file=sys.stderr, flush=True)
        mean = statistics.fmean(len(c.history) - 1 for c in cases)
        for name, results in (("adaptive (Ada-KV, kvzip scores)", adaptive), ("calibrated (TANGRAM)", calibrated)):
            for keep, rows in results.items():
                if rows:
                    cells = [f"+{100 * statistics.fmean(r[key] for r in rows):.1f}%"
                             for key in sorted(rows[0], key=lambda k: (k[0], k[1]))]
                    table.row([f"~{length:,} ({mean:.0f})", name, f"{keep:g}", *cells])


if __name__ == "__main__":
    main()
