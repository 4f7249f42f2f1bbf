"""The prefill attention over a restored per-head state on a GPU (issue 34): milliseconds of device time
for the GQA-packed path the worker runs (compression/attention_stats.py `packed_biased_attention`) beside
the per-group loop it replaced, the plain reference (K and V repeated per query head) and unbiased GQA
attention (the floor), at the shapes the GPU restore benchmark uses. Random tensors: time depends on the
shapes, not the values; each path's largest difference from the reference is printed beside its time.

    python -m benchmarks.gpu_attention --json OUT
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from benchmarks.harness.results import machine_record, write_json
from benchmarks.harness.tables import markdown_table
from statekeeper.compression.attention_stats import _biased_attention_reference, packed_biased_attention
from statekeeper.device_profile import device_time_ms

# (query heads, KV heads, head dim, history tokens, message tokens): Llama 8B's and SmolLM2's shapes
CASES = [(32, 8, 128, 16384, 48), (32, 8, 128, 4096, 288), (32, 8, 128, 16384, 512), (9, 3, 64, 4096, 288),
         (9, 3, 64, 16384, 51)]


def per_group_loop(query, key, value, causal, bias, scaling):
    """The path before packing: one SDPA call per position in the GQA group under an [Hkv, s, n] mask."""
    groups = query.shape[1] // key.shape[1]
    mask = bias[None, :, None, : key.shape[2]].to(query.dtype).masked_fill(~causal, -math.inf)
    output = torch.empty_like(query)
    for group in range(groups):
        output[:, group::groups] = torch.nn.functional.scaled_dot_product_attention(
            query[:, group::groups], key, value, attn_mask=mask, scale=scaling)
    return output.transpose(1, 2)


def measure(case, repeats: int) -> dict:
    query_heads, kv_heads, head_dim, history, num_queries = case
    num_keys, device, dtype = history + num_queries, "cuda", torch.bfloat16
    generator = torch.Generator(device).manual_seed(0)
    query = torch.randn(1, query_heads, num_queries, head_dim, device=device, dtype=dtype, generator=generator)
    key = torch.randn(1, kv_heads, num_keys, head_dim, device=device, dtype=dtype, generator=generator)
    value = torch.randn(1, kv_heads, num_keys, head_dim, device=device, dtype=dtype, generator=generator)
    bias = torch.zeros(kv_heads, num_keys + 128, device=device, dtype=dtype)  # a cache's buffer
    evicted = torch.rand(kv_heads, history, device=device, generator=generator) < 0.7
    bias[:, :history].masked_fill_(evicted, -math.inf)
    causal = torch.ones(num_queries, num_keys, dtype=torch.bool, device=device).tril(history)[None, None]
    scaling = head_dim**-0.5
    paths = {
        "packed (the worker's)": lambda: packed_biased_attention(query, key, value, causal, bias, scaling),
        "per-group loop (before)": lambda: per_group_loop(query, key, value, causal, bias, scaling),
        "reference": lambda: _biased_attention_reference(query, key, value, causal, bias, scaling)[0],
        "unbiased GQA (floor)": lambda: torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=causal, scale=scaling, enable_gqa=True),
    }
    reference = paths["reference"]().float()
    result = {"shape": dict(zip(("query_heads", "kv_heads", "head_dim", "history", "queries"), case)),
              "ms": {}, "max_abs_diff": {}}
    for name, run in paths.items():
        result["ms"][name] = round(device_time_ms(run, repeats, warmups=3), 4)
        if "floor" not in name:
            result["max_abs_diff"][name] = float((run().float() - reference).abs().max())
    result["loop_over_packed"] = round(result["ms"]["per-group loop (before)"] / result["ms"]["packed (the worker's)"], 3)
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: this benchmark measures a GPU")
    machine = machine_record() | {"gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda}
    results, rows = {"command": " ".join(sys.argv), "cases": []}, []
    for case in CASES:
        result = measure(case, args.repeats)
        results["cases"].append(result)
        rows.append([str(case)] + [result["ms"][name] for name in result["ms"]] + [result["loop_over_packed"]])
    print(f"biased prefill attention on {machine['gpu']}, device ms (median of {args.repeats}):")
    print(markdown_table(["(Hq, Hkv, d, history, queries)", "packed", "per-group loop", "reference",
                          "unbiased floor", "loop / packed"], rows))
    if args.json:
        write_json(args.json, results, machine)


if __name__ == "__main__":
    main()
