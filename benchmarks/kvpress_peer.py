"""Peer comparison on the needle task: NVIDIA kvpress presses on the same model and the same needles as
`benchmarks/fidelity.py` (issue 5). kvpress 0.5.5 needs transformers < 5.3, so it runs in its own
environment, never in the service's:

    bash scripts/kvpress-env.sh          # creates .venv-kvpress
    .venv-kvpress/bin/python benchmarks/kvpress_peer.py --keep 0.5,0.25,0.07 --lengths 1000,2000

Each needle's history is prefilled under the press (the question is never seen by the press: kvpress's
own pipeline does the same), then the question and the answer prefix are fed and 12 tokens decoded
greedily; correct when the fact appears in the answer. `--keep` is the fraction of KV entries kept
(kvpress's compression_ratio = 1 - keep); kvpress keeps them in the model's dtype (fp32 here), so the
stored-byte fraction of a press equals its keep fraction."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from statekeeper.chat import ChatFormatter  # noqa: E402
from statekeeper.datasets import sharegpt_conversations  # noqa: E402
from statekeeper.needles import make_needles  # noqa: E402


def presses(keep: float) -> dict:
    from kvpress import AdaKVPress, ExpectedAttentionPress, KVzipPress, SnapKVPress

    ratio = 1.0 - keep
    return {"SnapKV": SnapKVPress(compression_ratio=ratio),
            "AdaKV(SnapKV)": AdaKVPress(SnapKVPress(compression_ratio=ratio)),
            "ExpectedAttention": ExpectedAttentionPress(compression_ratio=ratio),
            "KVzip": KVzipPress(compression_ratio=ratio)}


@torch.inference_mode()
def answer(model, tokenizer, press, context: list[int], question: list[int], max_tokens: int = 12) -> str:
    from transformers import DynamicCache

    cache = DynamicCache()
    with press(model):
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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", help="the converted SmolLM2 directory (default: the only one under .cache/models)")
    parser.add_argument("--keep", default="0.5,0.25")
    parser.add_argument("--lengths", default="1000,2000")
    parser.add_argument("--needles", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model_dir) if args.model_dir else next((Path(__file__).resolve().parents[1] / ".cache" / "models").iterdir())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    formatter, eos = ChatFormatter(tokenizer), tokenizer.eos_token_id
    print("| history | press | keep (stored fraction) | needles | seconds per needle |")
    print("|---|---|---|---|---|")
    for length in (int(x) for x in args.lengths.split(",")):
        fillers = (c for c in sharegpt_conversations(min_turns=2) if max(len(m) for _, m in c) < 4000)
        needles = make_needles(args.needles, fillers, formatter, length, seed=length)  # as benchmarks/fidelity.py
        cases = []
        for needle in needles:
            history, _ = formatter.append_turns([], [], needle.history, eos)
            prompt = formatter.extend(history, needle.history + [{"role": "user", "content": needle.question}]).tokens
            cases.append((history, prompt[len(history):] + formatter.encode(needle.answer_prefix), needle.fact))
        for keep in (float(x) for x in args.keep.split(",")):
            for name, press in presses(keep).items():
                started, correct = time.perf_counter(), 0
                for history, question, fact in cases:
                    correct += fact.lower() in answer(model, tokenizer, press, history, question).lower()
                seconds = (time.perf_counter() - started) / len(cases)
                print(f"| ~{length:,} | {name} | {keep:g} | {correct}/{len(cases)} | {seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
