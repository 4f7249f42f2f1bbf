"""Fidelity of compressed conversation states on real workloads (also `statekeeper eval`).

    python -m benchmarks.fidelity --methods none,int8,int4 --conversations 50 --needles 20 --lengths 1000,2000

ShareGPT: for conversations with >= 4 turns, the state after the turn whose history reaches about the
target length is compressed; the real next user turn and assistant reply are teacher-forced; reported:
top-1 agreement with the full state, mean KL(full || compressed) per assistant token, perplexity ratio.
Needles: a fact planted and restated in the first turn, ShareGPT filler turns up to the target length,
then the question; graded on the greedy answer, plus the teacher-forced log-probability of the fact.
Recall (`--recall`, 20 per length): several facts planted in the first user message, unrelated ShareGPT
turns up to the target length, then a question about one or two of them and a teacher-forced answer
restating them; reported: top-1 agreement with the full state on the answer tokens and the answer's
mean log-probability. Only this workload: `--conversations 0 --needles 0`."""

from __future__ import annotations

from statekeeper.evaluation.fidelity import main

if __name__ == "__main__":
    main()
