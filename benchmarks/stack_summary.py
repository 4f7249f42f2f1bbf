"""Where a thread's time went, from py-spy's raw collapsed stacks (`py-spy record -f raw`): each function's
share of the samples whose stack passes through --through (inclusive: anywhere on the stack; self: at its
top), the line for self time. scripts/gpu-check.sh summarises the service's model thread with it on a lent
GPU machine (the raw file is too large to bring back).

    python -m benchmarks.stack_summary pyspy-service.txt --through scheduler/model_thread.py
"""

from __future__ import annotations

import argparse
import collections
import re


def summarise(lines, through: str) -> tuple[int, int, collections.Counter, collections.Counter]:
    inclusive, self_time = collections.Counter(), collections.Counter()
    total = passing = 0
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not count.isdigit():
            continue
        samples = int(count)
        total += samples
        if through not in stack:
            continue
        passing += samples
        frames = stack.split(";")
        for function in {re.sub(r":\d+\)$", ")", frame) for frame in frames}:
            inclusive[function] += samples
        self_time[frames[-1]] += samples
    return total, passing, inclusive, self_time


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path")
    parser.add_argument("--through", default="scheduler/model_thread.py")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args(argv)
    with open(args.path) as lines:
        total, passing, inclusive, self_time = summarise(lines, args.through)
    print(f"{total} samples, {passing} through {args.through}")
    for title, counter in (("inclusive", inclusive), ("self (function and line)", self_time)):
        print(f"-- {title}")
        for function, samples in counter.most_common(args.top):
            print(f"{100 * samples / max(passing, 1):6.1f}% {function}")


if __name__ == "__main__":
    main()
