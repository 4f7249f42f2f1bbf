"""Peer comparison on the needle task: NVIDIA kvpress presses on the same model and the same needles as
`benchmarks/fidelity.py` (issue 5). kvpress 0.5.5 needs transformers < 5.3, so it runs in its own
environment, never in the service's:

    bash scripts/kvpress-env.sh          # creates .venv-kvpress
    .venv-kvpress/bin/python -m benchmarks.kvpress_peer --keep 0.5,0.25,0.07 --lengths 1000,2000

Each needle's history is prefilled under the press exactly as kvpress's own pipeline
(`KVPressTextGenerationPipeline._forward`) does it: `with press(model): model.model(input_ids=context,
past_key_values=cache)`, so the press never sees the question. KVzip's context-reconstruction passes run
inside that same `with` block, on its exit (KVzipPress.__call__ captures the context ids and the cache,
then replays "Repeat the previous context" over them before the block closes). The question and the
answer prefix are then fed at positions len(context).. (the pipeline's `generate_answer` also continues
from the uncompressed context length) and 12 tokens decoded greedily; correct when the fact appears in
the answer. "no press" is the same loop with the full KV (keep 1).

`--keep` is the fraction of KV entries kept (kvpress's compression_ratio = 1 - keep); kvpress keeps them
in the model's dtype (fp32 here), so the stored-byte fraction of a press equals its keep fraction.
SnapKV and ExpectedAttention really prune the cache (each layer holds keep x len(context) entries);
AdaKV and KVzip evict a different number per head, which kvpress 0.5.5 only simulates: the cache keeps
its full length and the evicted keys are overwritten, at every later step, by a fake key whose attention
weight is zero (kvpress/attention_patch.py, sdpa only). Their accuracy is that of the real eviction;
their stored fraction is what a head-wise cache would hold, not what kvpress's in-memory cache holds."""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path

import torch

from benchmarks.harness import MODEL_CACHE, StreamedTable
from statekeeper.chat import ChatFormatter
from statekeeper.evaluation.datasets import sharegpt_conversations
from statekeeper.evaluation.needles import make_needles


def presses(keep: float) -> dict:
    from kvpress import AdaKVPress, ExpectedAttentionPress, KVzipPress, SnapKVPress

    ratio = 1.0 - keep  # KVzip logs a warning about its 2-3x prefill cost when constructed
    return {"SnapKV": SnapKVPress(compression_ratio=ratio),
            "AdaKV(SnapKV)": AdaKVPress(SnapKVPress(compression_ratio=ratio)),
            "ExpectedAttention": ExpectedAttentionPress(compression_ratio=ratio),
            "KVzip": KVzipPress(compression_ratio=ratio)}


@torch.inference_mode()
def answer(model, tokenizer, press, context: list[int], question: list[int], max_tokens: int = 12) -> str:
    from transformers import DynamicCache

    cache = DynamicCache()
    # Prefill without the LM head, as kvpress's pipeline; `input_ids` must be a keyword (KVzip reads it)
    with press(model) if press is not None else contextlib.nullcontext():
        model.model(input_ids=torch.tensor([context]), past_key_values=cache)
    positions = torch.arange(len(context), len(context) + len(question))[None]
    logits = model(input_ids=torch.tensor([question]), past_key_values=cache, position_ids=positions,
                   logits_to_keep=1).logits
    generated, position = [], len(context) + len(question)
    for step in range(max_tokens):
        token = int(logits[0, -1].argmax())
        if token == tokenizer.eos_token_id:
            break
        generated.append(token)
        logits = model(input_ids=torch.tensor([[token]]), past_key_values=cache,
                       position_ids=torch.tensor([[position + step]])).logits
    return tokenizer.decode(generated, skip_special_tokens=True)


def main() -> None:
    import kvpress  # noqa: F401  (patches transformers' attention functions for AdaKV/KVzip's head-wise masking)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", help="the converted SmolLM2 directory (default: the only one under .cache/models)")
    parser.add_argument("--keep", default="0.5,0.25")
    parser.add_argument("--lengths", default="1000,2000")
    parser.add_argument("--needles", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--presses", default="SnapKV,AdaKV(SnapKV),ExpectedAttention,KVzip")
    args = parser.parse_args()
    chosen = set(args.presses.split(","))
    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    model_dir = Path(args.model_dir) if args.model_dir else next(MODEL_CACHE.iterdir())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # sdpa: AdaKV and KVzip refuse eager attention (their masking patches the non-eager attention functions)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    formatter, eos = ChatFormatter(tokenizer), tokenizer.eos_token_id
    table = StreamedTable(["history", "press", "keep (stored fraction)", "needles", "seconds per needle"])
    for length in (int(x) for x in args.lengths.split(",")):
        fillers = (c for c in sharegpt_conversations(min_turns=2) if max(len(m) for _, m in c) < 4000)
        needles = make_needles(args.needles, fillers, formatter, length, seed=length)  # as benchmarks/fidelity.py
        cases = []
        for needle in needles:
            history, _ = formatter.append_turns([], [], needle.history, eos)
            prompt = formatter.extend(history, needle.history + [{"role": "user", "content": needle.question}]).tokens
            cases.append((history, prompt[len(history):] + formatter.encode(needle.answer_prefix), needle.fact))
        runs = [("no press", 1.0, None)]  # the full-KV baseline in this environment
        for keep in (float(x) for x in args.keep.split(",")):
            runs += [(name, keep, press) for name, press in presses(keep).items() if name in chosen]
        for name, keep, press in runs:
            started, correct = time.perf_counter(), 0
            for history, question, fact in cases:
                correct += fact.lower() in answer(model, tokenizer, press, history, question).lower()
            seconds = (time.perf_counter() - started) / len(cases)
            table.row([f"~{length:,}", name, f"{keep:g}", f"{correct}/{len(cases)}", f"{seconds:.1f}"])


if __name__ == "__main__":
    main()
