"""Integer codec for a stored state's tensors (kernels/quant.py), applied after any other compression.

Order: cross-layer sharing (or eviction) decides *what* is stored, on full-precision vectors (SLERP
needs exact directions); the codec then decides *how* each stored vector is written. Only K and V
rows are quantized (".k", ".v", merged directions and retained rows, by name); norms, masks, indices
and votes stay as they are. A quantized tensor `name` is stored
as `name.codes`, `name.scale`, `name.zero`, described in the blob meta under "quant", and dequantized
on restore before the rest of the restore path sees it.

`-s<N>` also keeps the rows of the first N history tokens exact (16-bit) next to their codes: the
attention sink (token 0 draws a large share of every query's attention, so its key's quantization error
moves every logit; IntactKV and KVQuant keep it in full precision). On SmolLM2, token 0 alone is worth
~0.4 points of int4's top-1 agreement for under 1% more bytes (BENCHMARKS.md).

`-pk<P>` writes the P percent of each key tensor's rows that the method scored highest (per-head
eviction's KVzip scores, `Compressed.row_scores`) at 8 bits instead of 4, and only there: on SmolLM2
nearly all of int4's error on recall of early facts is in the keys (BENCHMARKS.md, issue 13), and the
entries the eviction ranks highest are the ones later queries attend to. Rows without scores (a dense
state, a blob re-encoded for a tier) are written at the keys' bits. Which rows those are is stored as a
bit per row (`name.precise_mask`) or, where that is larger (under 1 row in 16), as row numbers
(`name.precise_rows`, as blobs before the mask were written).

`-sym` writes symmetric codes (kernels/quant.py: no zero point, 2 bytes less per group) for keys and
values, `-vsym` for values only: Hadamard-rotated rows are near zero-mean, so a range centred on zero
costs them little (its price is measured in BENCHMARKS.md, issue 13)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.quant import BITS, Quantized, dequantize, mask_count, mask_set_past, pack_mask, quantize, rotation, unpack_mask
from statekeeper.compression.head_budget import kept_rows
from statekeeper.config import codec_options

Named = list[tuple[str, torch.Tensor]]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}  # by the names blobs use
_VECTORS = (".k", ".v", ".direction", ".original_a", ".original_b")  # rows of head_dim elements
ROTATION_SEED = 0


@dataclass(slots=True)
class IntCodec:
    bits: int = 8
    group_size: int = 64  # elements per scale and zero point
    # Keys grouped per channel along tokens (KIVI: key outliers sit in fixed channels) instead of per
    # token along channels; values are always grouped per token.
    keys_per_channel: bool = False
    # Rows rotated by a randomized Hadamard matrix before quantizing (kernels/quant.py `rotation`).
    rotate: bool = False
    exact_tokens: int = 0  # rows of the first N history tokens also stored exact (16-bit)
    # Values ("*.v" rows) at their own precision: values carry little of int4's error on this model
    # (BENCHMARKS.md: K-only KL 0.0050, V-only 0.0004), so they take fewer bits. None: as the keys.
    value_bits: int | None = None
    value_group_size: int | None = None
    precise_key_percent: int = 0  # keys: the top-scored P% of rows at 8 bits (needs row scores)
    symmetric_values: bool = False  # codes without a zero point (rotated rows): values ...
    symmetric_keys: bool = False  # ... and keys too

    def __post_init__(self):
        if self.bits not in (4, 8) or self.value_bits not in (None, *BITS):
            raise ValueError(f"codec bits: keys 4 or 8, values one of {BITS}")
        if self.symmetric_keys and not self.symmetric_values:
            raise ValueError("symmetric keys come with symmetric values (-sym); -vsym is values only")

    @property
    def name(self) -> str:
        values = f"-v{self.value_bits}" if self.value_bits not in (None, self.bits) else ""
        symmetric = "-sym" if self.symmetric_keys else "-vsym" if self.symmetric_values else ""
        options = values + ("-kc" if self.keys_per_channel else "") + ("-rot" if self.rotate else "") + symmetric
        value_group = self.value_group_size if self.value_group_size not in (None, self.group_size) else None
        return (f"int{self.bits}{options}" + (f"-g{self.group_size}" if self.group_size != 64 else "")
                + (f"-vg{value_group}" if value_group else "")
                + (f"-pk{self.precise_key_percent}" if self.precise_key_percent else "")
                + (f"-s{self.exact_tokens}" if self.exact_tokens else ""))

    @property
    def total_bits(self) -> int:
        """Key bits plus value bits: the order in which a tier's codec is a ceiling (compression/transcode.py)."""
        return self.bits + (self.value_bits or self.bits)

    def _precision(self, name: str) -> tuple[int, int]:
        if name.endswith(".v"):
            return self.value_bits or self.bits, self.value_group_size or self.group_size
        return self.bits, self.group_size

    def _is_symmetric(self, name: str) -> bool:
        return self.symmetric_values if name.endswith(".v") else self.symmetric_keys

    def encode(self, tensors: Named, head_dim: int,
               row_scores: dict[str, torch.Tensor] | None = None) -> tuple[Named, dict]:
        """`row_scores`: per tensor name, a score per row of its [-1, head_dim] view (for `-pk<P>`)."""
        out, described, named = [], {}, dict(tensors)
        for name, tensor in tensors:
            if not name.endswith(_VECTORS) or tensor.shape[-1] != head_dim or not tensor.numel():
                out.append((name, tensor))
                continue
            info = {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape)}
            exact = self._exact_rows(name, tensor, named)
            if exact is not None:
                out += exact
                info["exact"] = True
            if self.rotate:
                tensor = tensor.float() @ rotation(head_dim, ROTATION_SEED)
                info["rotation"] = ROTATION_SEED
            bits, group_size = self._precision(name)
            symmetric = self._is_symmetric(name)
            if symmetric:
                info["symmetric"] = True
            precise = self._precise_rows(name, tensor, (row_scores or {}).get(name))
            if precise is not None:  # those rows at 8 bits, the rest below at `bits`
                rows = tensor.reshape(-1, head_dim)
                rest = torch.ones(len(rows), dtype=torch.bool)
                rest[precise] = False
                q = quantize(rows[precise], 8, -1, math.gcd(group_size, head_dim), symmetric)
                out += _parts(f"{name}.precise", q) + [_precise_rows_tensor(name, precise, rest)]
                info["precise"] = {"rows": len(precise), "group_size": q.group_size}
                tensor = rows[rest]
            if self.keys_per_channel and name.endswith(".k"):
                rows = tensor.reshape(-1, tensor.shape[-2], head_dim) if tensor.dim() > 2 else tensor[None]
                padded = -(-rows.shape[1] // group_size) * group_size  # repeat the last row to fill
                rows = torch.cat([rows, rows[:, -1:].expand(-1, padded - rows.shape[1], -1)], dim=1)
                q = quantize(rows, bits, 1, group_size, symmetric)
                info |= {"axis": "tokens", "padded": list(rows.shape)}
            else:
                q = quantize(tensor, bits, -1, math.gcd(group_size, head_dim), symmetric)
            out += _parts(name, q)
            described[name] = info | {"bits": q.bits, "group_size": q.group_size}
        return out, {"codec": self.name, "group_size": self.group_size, "tensors": described}

    def _precise_rows(self, name: str, tensor: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor | None:
        """Row numbers (ascending) of the top `precise_key_percent`% of a key tensor's rows by score, or None."""
        rows = tensor.numel() // tensor.shape[-1]
        if not self.precise_key_percent or not name.endswith(".k") or scores is None or len(scores) != rows:
            return None
        count = math.ceil(self.precise_key_percent * rows / 100)
        return scores.float().topk(count).indices.sort().values

    def _exact_rows(self, name: str, tensor: torch.Tensor, named: dict) -> Named | None:
        """`name.exact` (the rows of the first `exact_tokens` positions, 16-bit) and `name.exact_rows`
        (their row numbers in the tensor's [-1, head_dim] view), or None where there are none. Positions:
        the token axis of a dense [heads, tokens, dim] tensor, the kept positions of a per-head ragged one;
        merged pair rows carry no positions and are only quantized."""
        if not self.exact_tokens:
            return None
        index = kept_positions(named, name.rpartition('.')[0])
        if tensor.dim() == 3:
            positions = torch.arange(tensor.shape[1]).expand(tensor.shape[0], -1).reshape(-1)
        elif tensor.dim() == 2 and index is not None and len(index) == len(tensor):
            positions = index
        else:
            return None
        rows = (positions < self.exact_tokens).nonzero()[:, 0]
        if not len(rows):
            return None
        values = tensor.reshape(-1, tensor.shape[-1])[rows]
        if values.dtype.itemsize > 2 and bool(values.abs().max() < torch.finfo(torch.float16).max):
            values = values.to(torch.float16)
        return [(f"{name}.exact", values), (f"{name}.exact_rows", rows.to(torch.int32))]


def _parts(name: str, q: Quantized) -> Named:
    """A quantized tensor's stored parts: codes, scale and (unless symmetric) zero point."""
    return [(f"{name}.codes", q.codes), (f"{name}.scale", q.scale)] + ([] if q.zero is None else [(f"{name}.zero", q.zero)])


def _pop_parts(result: dict[str, torch.Tensor], name: str, symmetric: bool) -> list:
    return [result.pop(f"{name}.codes"), result.pop(f"{name}.scale"), None if symmetric else result.pop(f"{name}.zero")]


def _precise_rows_tensor(name: str, precise: torch.Tensor, rest: torch.Tensor) -> tuple[str, torch.Tensor]:
    """Which rows are at 8 bits: a bit per row, or their numbers where those take fewer bytes."""
    rows = len(rest)
    if -(-rows // 8) <= 2 * len(precise):
        return f"{name}.precise_mask", pack_mask(~rest)
    return f"{name}.precise_rows", precise.to(torch.int16 if rows < 2**15 else torch.int32)


def _pop_precise_rows(result: dict[str, torch.Tensor], name: str, total_rows: int, count: int) -> torch.Tensor:
    """The 8-bit rows' numbers. On a GPU, from the mask without a host wait: `count` of them, as the blob's
    description says (statekeeper/device_restore.py checks the same mask on the host first, `check_precise`)."""
    mask = result.pop(f"{name}.precise_mask", None)
    if mask is None:
        numbers = result.pop(f"{name}.precise_rows").long()
        if numbers.device.type == "cpu":  # a GPU restore's host checks read them first (check_row_numbers)
            check_row_numbers(f"{name}.precise_rows", numbers, total_rows, count)
        return numbers
    if mask.device.type != "cpu":
        return torch.nonzero_static(unpack_mask(mask)[:total_rows], size=count)[:, 0]
    check_precise(name, mask, total_rows)
    return unpack_mask(mask)[:total_rows].nonzero()[:, 0]


def check_row_numbers(name: str, numbers: torch.Tensor, total_rows: int, count: int) -> None:
    """ValueError unless `numbers` are `count` distinct row numbers below `total_rows`: a duplicate would leave
    a row of the decoded tensor unwritten, one out of range would write outside it."""
    if numbers.dim() != 1 or len(numbers) != count or (count and (
            int(numbers.min()) < 0 or int(numbers.max()) >= total_rows or len(numbers.unique()) != count)):
        raise ValueError(f"{name}: not {count} distinct rows of {total_rows}")


def check_precise(name: str, packed: torch.Tensor, total_rows: int, count: int | None = None) -> None:
    """ValueError unless the packed mask of `name`'s 8-bit rows fits its `total_rows` (and marks `count`),
    read a byte at a time (no unpacked copy of it)."""
    if packed.dim() != 1 or 8 * len(packed) < total_rows or mask_set_past(packed, total_rows) or (
            count is not None and int(mask_count(packed)) != count):
        raise ValueError(f"{name}: the mask of 8-bit rows does not fit the tensor")


def kept_positions(named: dict[str, torch.Tensor], layer: str) -> torch.Tensor | None:
    """The positions of a per-head ragged layer's kept rows in their stored order (compression/head_budget.py),
    or None where `layer` has none."""
    try:
        return kept_rows({name: named[f"{layer}.{name}"] for name in ("index", "kept", "counts")
                          if f"{layer}.{name}" in named})[1]
    except (KeyError, ValueError):
        return None


def decode(tensors: dict[str, torch.Tensor], quant: dict) -> dict[str, torch.Tensor]:
    """Replaces each quantized tensor's parts with the dequantized tensor; raises KeyError/ValueError/
    RuntimeError on a blob whose description does not fit its tensors."""
    result = dict(tensors)
    for name, info in quant["tensors"].items():
        symmetric = bool(info.get("symmetric"))
        parts = _pop_parts(result, name, symmetric)
        shape, dtype = tuple(info["shape"]), DTYPES[info["dtype"]]
        precise = info.get("precise")
        total_rows = math.prod(shape[:-1])
        written = shape if precise is None else (total_rows - int(precise["rows"]), shape[-1])  # the rest
        if info.get("axis") == "tokens":
            padded = tuple(info["padded"])
            rows = dequantize(Quantized(*parts, int(info["bits"]), padded, 1, int(info["group_size"]), dtype))
            result[name] = rows[:, : written[-2]].reshape(written)
        else:
            q = Quantized(*parts, int(info["bits"]), written, len(written) - 1, int(info["group_size"]), dtype)
            result[name] = dequantize(q)
        if precise is not None:
            high = _pop_parts(result, f"{name}.precise", symmetric)
            rows = _pop_precise_rows(result, name, total_rows, int(precise["rows"]))
            device = result[name].device  # the codes' device: a GPU restore decodes there (statekeeper/device_restore.py)
            full = torch.empty(total_rows, shape[-1], dtype=dtype, device=device)
            rest = torch.ones(total_rows, dtype=torch.bool, device=device)
            rest.index_fill_(0, rows, False)  # not rest[rows] = False: a host scalar, copied with a wait on a GPU
            # the other rows by number, counted from the description: a mask index would wait for the GPU
            full[torch.nonzero_static(rest, size=total_rows - len(rows))[:, 0]] = result[name]
            full[rows] = dequantize(Quantized(*high, 8, (len(rows), shape[-1]), 1, int(precise["group_size"]), dtype))
            result[name] = full.reshape(shape)
        if "rotation" in info:
            turn = rotation(shape[-1], int(info["rotation"]), result[name].device)
            result[name] = (result[name].float() @ turn.T).to(dtype)
        if info.get("exact"):
            exact, rows = result.pop(f"{name}.exact"), result.pop(f"{name}.exact_rows").long()
            if rows.device.type == "cpu":
                check_row_numbers(f"{name}.exact_rows", rows, total_rows, len(exact))
            result[name] = result[name].contiguous()  # freshly dequantized: written in place
            result[name].view(-1, shape[-1])[rows] = exact.to(dtype)
    return result


def by_name(codec: str, group_size: int = 64) -> IntCodec | None:
    """`int8` / `int4`, then options in this order: `-v<B>` values at B bits (2, 3, 4 or 8), `-kc` keys
    grouped per channel along tokens, `-rot` rows Hadamard-rotated first, `-sym` / `-vsym` symmetric codes
    for keys and values / values only, `-g<N>` N elements per scale and
    zero point (else `group_size`), `-vg<N>` the values' own group size, `-pk<P>` the top-scored P% of
    key rows at 8 bits, `-s<N>` the first N history tokens' rows also kept exact."""
    options = codec_options(codec, group_size)
    return None if options is None else IntCodec(**options)
