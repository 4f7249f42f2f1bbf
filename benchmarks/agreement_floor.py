"""How often two lossless computations of the same answer disagree: the floor under a top-1 agreement target.

    python -m benchmarks.agreement_floor --lengths 1000,2000,4000 --heldout 24 --json floor.json

The held-out recall cases of `statekeeper eval --heldout` (the same conversations, facts and answers), each
teacher-forced twice on full, uncompressed KV: once with the KV cache in float32, once in bfloat16, the two
KV dtypes the service itself chooses between by CPU (KV_DTYPE=auto, statekeeper/kv_dtype_choice.py). Nothing
is evicted or quantized beyond that rounding of every KV entry, so the top-1 agreement between the two is
how far a comparison against full KV can be trusted: a compressed state's disagreements at or below this
rate are at the noise floor of the model's near-ties. Prints per length the agreement, the mean KL, and the
full-KV (float32) margins of the flipped tokens (top-1 minus runner-up, nats)."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.harness import add_model_arguments, load_worker, machine_line, markdown_table, write_json
from statekeeper.chat import ChatFormatter
from statekeeper.evaluation.fidelity import HELDOUT, recall_cases
from statekeeper.evaluation.teacher_forcing import FidelityTotals, build_state, compare_rows, log_probs
from statekeeper.worker import ModelWorker

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def answer_rows(worker: ModelWorker, case, dtype: torch.dtype) -> torch.Tensor:
    """Log-probs of the continuation on full KV held in `dtype` (history prefilled, then teacher-forced)."""
    worker.use_kv_dtype(dtype)
    state = build_state(worker, case.history[:-1])
    return log_probs(worker, state.cache, case.history[-1:] + case.continuation)


def floor_row(worker: ModelWorker, cases, reference: str, other: str) -> dict:
    totals = FidelityTotals()
    for case in cases:
        full = answer_rows(worker, case, DTYPES[reference])
        totals.add(compare_rows(full, answer_rows(worker, case, DTYPES[other]), case.continuation, case.spans))
    return {"reference": reference, "other": other, "cases": len(cases),
            "history_tokens_mean": sum(len(c.history) - 1 for c in cases) / max(1, len(cases)),
            "tokens": totals.tokens, "agreements": totals.agreements, "top1_agreement": totals.top1_agreement,
            "mean_kl": totals.mean_kl, "flipped_margins": sorted(totals.flipped_margins)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1000,2000,4000")
    parser.add_argument("--heldout", type=int, default=24, help="held-out recall conversations per length")
    add_model_arguments(parser, threads=2)
    parser.add_argument("--reference", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--other", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    worker = load_worker(args)
    formatter = ChatFormatter(worker.tokenizer)
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        cases = recall_cases(HELDOUT, args.heldout, formatter, length, worker.tokenizer.eos_token_id)
        rows.append({"length": length, **floor_row(worker, cases, args.reference, args.other)})
        print(f"length {length}: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    print(machine_line())
    print(markdown_table(["history", "answer tokens", f"top-1 agreement ({args.other} KV against {args.reference})",
                          "mean KL", "flipped tokens' margins (nats)"],
                         [[f"~{r['length']:,} ({r['history_tokens_mean']:.0f})", r["tokens"],
                           f"{r['top1_agreement']:.4f} ({r['agreements']}/{r['tokens']})", f"{r['mean_kl']:.5f}",
                           ", ".join(f"{m:.3f}" for m in r["flipped_margins"])] for r in rows]))
    if args.json:
        write_json(args.json, {"command": " ".join(["python -m benchmarks.agreement_floor", *(argv or sys.argv[1:])]),
                               "rows": rows})


if __name__ == "__main__":
    main()
