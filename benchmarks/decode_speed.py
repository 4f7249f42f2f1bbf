"""Decode speed of a restored compressed session next to a hot lossless one, and what the restore step
costs next to a hot turn's prefill (issue 13, "free to read back").

Histories are real ShareGPT conversations (user and assistant turns through the chat template, as the
fidelity harness builds them) cut at the first turn boundary at or past each --lengths target; the
message is the conversation's next user turn, its first --message-tokens tokens. Each history's state is
compressed the way the service stores it (`compression.from_config` of the default CompressionConfig:
KVzip scores from the worker's reconstruction pass, per-head eviction keeping half, int4-rot-g32-s1),
written as a blob and read back with `serialization.decode_tensors`.

Probes, their order rotated every round, all in one process:
- decode: the message prefilled, then --steps greedy decode steps, each timed (ms/token: the median
  step), on (a) a copy of the hot lossless cache, (b) the state restored from the blob, (c) the same
  restored state with the attention the service used before (`_biased_attention_reference`: K/V
  repeated per query head and the mask rebuilt at every layer of every step), (d) the state a restore
  with an exact copy builds where the blob names a working set (COMPRESSION_LIVE_KEEP: the exact rows
  under a selection's bias, here the blob's own; without one the copy is taken whole, the hot state;
  issue 33); the four take turns at every step;
- restore: serialization.decode_tensors, then restore_state split into its int4 decode
  (codec.decode) and the scatter into dense layers with their bias, then KVCache.from_layers;
- first token: the message's prefill on the hot cache, against restore + prefill done one after the
  other, against `restore_compressed_layerwise` (the loader thread decodes layer l + 1 while the
  prefill computes layer l).
Every figure is the median over --rounds; ratios are medians of per-round ratios (the two probes ran
side by side in the same round).

    python -m benchmarks.decode_speed --threads 1 --json decode_speed.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import contextmanager, nullcontext

import torch

from benchmarks.harness import add_model_arguments, load_worker, machine_line, markdown_table, write_json
from benchmarks.harness.machine import commit
from statekeeper.chat import ChatFormatter
from statekeeper.compression import StoredForm, attention_stats, codec, from_config
from statekeeper.compression.registry import restorer
from statekeeper.config import CompressionConfig
from statekeeper.evaluation.datasets import sharegpt_conversations
from statekeeper.kv_cache import KVCache
from statekeeper.restore_pipeline import restore_compressed_layerwise
from statekeeper.worker import ModelWorker
from storage import serialization


def pick_histories(worker: ModelWorker, targets: list[int], per_target: int, message_tokens: int):
    """(history tokens, message tokens) for `per_target` conversations per target length."""
    formatter, end_of_turn = ChatFormatter(worker.tokenizer), worker.tokenizer.eos_token_id
    picked, conversations = [], sharegpt_conversations(min_turns=3)
    for target in targets:
        found = 0
        for conversation in conversations:
            if max(len(content) for _, content in conversation) > 6000:
                continue
            messages = [{"role": role, "content": content} for role, content in conversation]
            for end in range(2, len(messages) - 1, 2):  # after an assistant reply, a user turn follows
                history, _ = formatter.append_turns([], [], messages[:end], end_of_turn)
                if len(history) < target:
                    continue
                if len(history) <= 1.25 * target:
                    new = formatter.extend(history, messages[: end + 1]).tokens[len(history) :]
                    if len(new) >= message_tokens:
                        picked.append((history, new[:message_tokens]))
                        found += 1
                break
            if found == per_target:
                break
    return picked


def stored_blob(worker: ModelWorker, history: list[int]) -> tuple[KVCache, bytearray, float]:
    """The hot cache, the default compression's blob (as the service stores it) and its compressed ratio."""
    cache, stats = worker.new_cache(), worker.new_stats()
    worker.prefill(cache, history, stats)
    stats.reconstruction = worker.reconstruction_scores(cache, history)
    compressed = from_config(CompressionConfig()).compress(cache.export_layers(), stats, cache.head_bias)
    blob = serialization.encode_tensors(compressed.tensors, worker.fingerprint, history, len(history), compressed.meta)
    full_bytes = sum(k.nbytes + v.nbytes for k, v in cache.export_layers())
    return cache, blob, full_bytes / compressed.stored_bytes


@contextmanager
def reference_attention():
    """The biased attention as it was before issue 13 (the reference the fast one is tested against)."""
    fast = attention_stats._biased_attention
    attention_stats._biased_attention = attention_stats._biased_attention_reference
    try:
        yield
    finally:
        attention_stats._biased_attention = fast


def restore_steps(worker: ModelWorker, blob, tokens: list[int]) -> tuple[KVCache, dict]:
    """restore_state's steps (compression/__init__.py), each timed, then the cache the service builds."""
    clock = [time.perf_counter()]

    def lap() -> float:
        clock.append(time.perf_counter())
        return (clock[-1] - clock[-2]) * 1e3

    header, tensors = serialization.decode_tensors(blob, worker.fingerprint, tokens)
    form = StoredForm.from_meta(header.meta)
    times = {"blob_ms": lap()}
    tensors = codec.decode(tensors, form.codec)
    times["int4_decode_ms"] = lap()
    layers, bias = restorer(form)(tensors, form, worker.num_layers)
    times["scatter_ms"] = lap()
    cache = KVCache.from_layers(layers, worker.device, bias)
    times["cache_ms"] = lap()
    times["restore_ms"] = sum(times.values())
    return cache, times


def decode_side_by_side(worker: ModelWorker, probes: dict, message: list[int], steps: int, offset: int) -> dict:
    """`probes`: name -> (cache, attention context). Each cache gets the message's prefill, then `steps`
    greedy decode steps (end-of-turn ignored), the probes taking turns at every step in a rotating order
    so that a change in the machine's load falls on all of them. Returns each probe's median step ms."""
    tokens, times, names = {}, {name: [] for name in probes}, list(probes)
    for name, (cache, attention) in probes.items():
        with attention():
            tokens[name] = int(worker.prefill(cache, message).argmax())
    for step in range(steps):
        first = (step + offset) % len(names)
        for name in names[first:] + names[:first]:
            cache, attention = probes[name]
            with attention():
                started = time.perf_counter()
                tokens[name] = int(worker.decode(cache, tokens[name]).argmax())
                times[name].append((time.perf_counter() - started) * 1e3)
    return {f"{name}_decode_ms": statistics.median(values) for name, values in times.items()}


def measure(worker: ModelWorker, history: list[int], message: list[int], args, step: int) -> dict:
    cache, blob, ratio = stored_blob(worker, history)
    hot_layers, tokens = cache.export_layers(), history + message
    restored = restore_steps(worker, blob, tokens)[0]
    restored_layers, restored_bias = restored.export_layers(), restored.head_bias

    def hot_copy() -> KVCache:
        return KVCache.from_layers(hot_layers, worker.device)

    def restored_copy() -> KVCache:
        return KVCache.from_layers(restored_layers, worker.device, restored_bias)

    def with_exact_copy() -> KVCache:
        """What a restore with an exact copy builds where the blob names a working set (sessions/restore.py
        `_from_exact_copy`, COMPRESSION_LIVE_KEEP; here the blob's own selection): the exact state under its
        bias, the same entries attended, exact (issue 33)."""
        return KVCache.from_layers(hot_layers, worker.device, restored_bias)

    def hot_ttft() -> dict:
        copy = hot_copy()
        started = time.perf_counter()
        worker.prefill(copy, message)
        return {"hot_ttft_ms": (time.perf_counter() - started) * 1e3}

    def layerwise() -> dict:
        started = time.perf_counter()
        header, tensors = serialization.decode_tensors(blob, worker.fingerprint, tokens)
        _, _, report = restore_compressed_layerwise(worker, tensors, StoredForm.from_meta(header.meta), tokens)
        assert report.fallback is None, report.fallback
        return {"layerwise_ttft_ms": (time.perf_counter() - started) * 1e3, "layerwise_wait_ms": report.wait_ms}

    def sequential() -> dict:
        started = time.perf_counter()
        restored, times = restore_steps(worker, blob, tokens)
        worker.prefill(restored, message)
        return times | {"sequential_ttft_ms": (time.perf_counter() - started) * 1e3}

    def decode() -> dict:
        return decode_side_by_side(worker, {"hot": (hot_copy(), nullcontext), "restored": (restored_copy(), nullcontext),
                                            "reference": (restored_copy(), reference_attention),
                                            "exact_copy": (with_exact_copy(), nullcontext)},
                                   message, args.steps, step)

    probes = {
        "decode": decode,
        "hot_ttft": hot_ttft,
        "sequential": sequential,
        "layerwise": layerwise,
    }
    for probe in probes.values():  # untimed: first touch of every path
        probe()
    samples = []
    for round_index in range(args.rounds):
        names = list(probes)
        order = names[(step + round_index) % len(names) :] + names[: (step + round_index) % len(names)]
        sample = {}
        for name in order:
            sample |= probes[name]()
        samples.append(sample)
    row = {"history_tokens": len(history), "message_tokens": len(message), "blob_mb": len(blob) / 1e6,
           "smaller_than_full": ratio}
    for key in samples[0]:
        row[key] = statistics.median(s[key] for s in samples)
    for name, over in (("restored_over_hot", ("restored_decode_ms", "hot_decode_ms")),
                       ("reference_over_hot", ("reference_decode_ms", "hot_decode_ms")),
                       ("exact_copy_over_hot", ("exact_copy_decode_ms", "hot_decode_ms")),
                       ("sequential_over_hot", ("sequential_ttft_ms", "hot_ttft_ms")),
                       ("layerwise_over_hot", ("layerwise_ttft_ms", "hot_ttft_ms"))):
        row[name] = statistics.median(s[over[0]] / s[over[1]] for s in samples)
    return row


def summarize(rows: list[dict]) -> str:
    headers = ["history tokens", "hot ms/token", "restored ms/token (×hot)",
               "before: reference attention ms/token (×hot)", "restored with an exact copy ms/token (×hot)",
               "restore ms: blob / int4 decode / scatter / cache = total", "hot prefill of the message ms",
               "restore + prefill ms (×hot)", "layer by layer ms (×hot)"]
    return markdown_table(headers, [[
        f"{r['history_tokens']:,}", f"{r['hot_decode_ms']:.1f}",
        f"{r['restored_decode_ms']:.1f} ({r['restored_over_hot']:.3f}×)",
        f"{r['reference_decode_ms']:.1f} ({r['reference_over_hot']:.2f}×)",
        f"{r['exact_copy_decode_ms']:.1f} ({r['exact_copy_over_hot']:.3f}×)",
        f"{r['blob_ms']:.1f} / {r['int4_decode_ms']:.1f} / {r['scatter_ms']:.1f} / {r['cache_ms']:.1f} = "
        f"{r['restore_ms']:.1f}",
        f"{r['hot_ttft_ms']:.0f}", f"{r['sequential_ttft_ms']:.0f} ({r['sequential_over_hot']:.3f}×)",
        f"{r['layerwise_ttft_ms']:.0f} ({r['layerwise_over_hot']:.3f}×)"] for r in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--lengths", default="1500,2000", help="history length targets (tokens)")
    parser.add_argument("--histories", type=int, default=2, help="conversations per target")
    parser.add_argument("--message-tokens", type=int, default=50)
    parser.add_argument("--steps", type=int, default=32, help="greedy decode steps per decode probe")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="write every measured row here")
    args = parser.parse_args()
    worker = load_worker(args)
    started = time.time()
    histories = pick_histories(worker, [int(x) for x in args.lengths.split(",")], args.histories, args.message_tokens)
    rows = []
    for step, (history, message) in enumerate(histories):
        rows.append(measure(worker, history, message, args, step))
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()}), flush=True)
    print(f"\nmachine: {machine_line()}, torch {torch.__version__}, "
          f"{args.threads} torch thread(s); commit {commit()}; {time.time() - started:.0f} s")
    print(summarize(rows))
    if args.json:
        write_json(args.json, {"rows": rows})


if __name__ == "__main__":
    main()
