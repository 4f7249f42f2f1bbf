"""One layer of a per-head compressed blob (compression/head_budget.py, any codec) decoded wherever its
bytes are, without the host waiting for the device: a GPU restore copies a layer's stored tensors (codes,
scales, kept-row bits) as they are stored and decodes them on the device (statekeeper/device_restore.py).

What would make the host wait on a GPU (a data-dependent row count: `nonzero`, a check read back with
`bool(...)`) is split off: `check_layers` runs the CPU restore's checks on the host's copy of the blob first
and returns the row counts, and the decode then needs no value from the device (`nonzero_static` with the
counts the host read): `decode_layers_into` for a group of layers at once where their codec settings agree
(`batchable`), `decode_layer_into` one layer at a time otherwise. The torch reference is the CPU restore itself (codec.decode, then
head_budget.scatter_layer and bias_of); the GPU suite compares the two."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.quant import Quantized, dequantize, mask_count, mask_set_past, rotation, unpack_mask
from statekeeper.compression import codec as codecs
from statekeeper.compression.form import StoredForm
from statekeeper.compression.head_budget import check_votes, kept_rows

_ROWS = ("index", "kept", "counts", "votes")


@dataclass(frozen=True, slots=True)
class LayerCounts:
    rows: int  # kept (head, position) entries: rows of K and of V


def layer_names(tensors: dict[str, torch.Tensor], index: int) -> list[str]:
    prefix = f"{index}."
    return [name for name in tensors if name.startswith(prefix)]


def decoded_layer(tensors: dict[str, torch.Tensor], form: StoredForm, index: int) -> dict[str, torch.Tensor]:
    """Layer `index`'s stored tensors, dequantized where they are (the codec decodes each tensor on its own;
    the CPU's layer-by-layer restore and a GPU's per-layer decode both read them so)."""
    prefix = f"{index}."
    own = {name: tensor for name, tensor in tensors.items() if name.startswith(prefix)}
    quant = form.codec
    if quant is None:
        return own
    return codecs.decode(own, quant | {"tensors": {name: info for name, info in quant["tensors"].items()
                                                   if name.startswith(prefix)}})


def check_layer(tensors: dict[str, torch.Tensor], form: StoredForm, index: int, heads: int) -> LayerCounts:
    """On the host: ValueError unless layer `index` of the blob restores into `heads` heads of
    `form.num_tokens` positions (the checks the CPU restore makes, on the row bookkeeping and the codec's
    masks, which are small), and the counts the device decode needs."""
    tokens = form.num_tokens or 0
    rows = {name: tensors[f"{index}.{name}"] for name in _ROWS if f"{index}.{name}" in tensors}
    if "counts" not in rows or len(rows["counts"]) != heads:
        raise ValueError(f"layer {index}: kept rows for {heads} heads expected")
    if "kept" not in rows and (bool((rows["counts"] < 0).any()) or int(rows["counts"].long().sum()) != len(rows["index"])
                               or (len(rows["index"]) and int(rows["index"].min()) < 0)):
        raise ValueError(f"layer {index}: kept row numbers do not match the counts per head")
    _, positions = kept_rows(rows)
    if len(positions) and int(positions.max()) >= tokens:
        raise ValueError(f"layer {index}: kept rows do not fit their positions")
    _check_rows(tensors, form, index, len(positions))
    return LayerCounts(len(positions))


def _check_rows(tensors: dict[str, torch.Tensor], form: StoredForm, index: int, count: int) -> None:
    """Layer `index`'s K and V hold `count` rows, and their 8-bit and exact row bookkeeping fits them, as do
    its merge votes."""
    check_votes(tensors.get(f"{index}.votes"), count)
    quant = form.codec or {"tensors": {}}
    for name in (f"{index}.k", f"{index}.v"):
        info = quant["tensors"].get(name)
        stored_rows = tensors[name].shape[0] if info is None else int(info["shape"][0])
        if stored_rows != count:
            raise ValueError(f"{name}: {stored_rows} rows for {count} kept entries")
        if info is None:
            continue
        if info.get("precise") and f"{name}.precise_mask" in tensors:
            codecs.check_precise(name, tensors[f"{name}.precise_mask"], count, int(info["precise"]["rows"]))
        elif info.get("precise"):
            codecs.check_row_numbers(f"{name}.precise_rows", tensors[f"{name}.precise_rows"].long(), count,
                                     int(info["precise"]["rows"]))
        if info.get("exact"):
            codecs.check_row_numbers(f"{name}.exact_rows", tensors[f"{name}.exact_rows"].long(), count,
                                     len(tensors[f"{name}.exact"]))


def check_layers(tensors: dict[str, torch.Tensor], form: StoredForm, num_layers: int, heads: int) -> list[LayerCounts]:
    """`check_layer` for every layer, the kept bits of all layers checked in a few operations at once (the
    restore's host time: a check per layer took ~0.35 ms on an H100's host, BENCHMARKS.md issue 34); the
    same ValueError for a blob that does not fit."""
    tokens = form.num_tokens or 0
    if not all(f"{index}.kept" in tensors and f"{index}.counts" in tensors for index in range(num_layers)):
        return [check_layer(tensors, form, index, heads) for index in range(num_layers)]
    kept = [tensors[f"{index}.kept"] for index in range(num_layers)]
    counts = [tensors[f"{index}.counts"] for index in range(num_layers)]
    if any(k.dim() != 2 or k.shape != kept[0].shape or len(c) != heads or len(k) != heads for k, c in zip(kept, counts)):
        raise ValueError(f"kept rows for {heads} heads expected in every layer")
    stacked = torch.stack(kept)  # [layers, heads, bytes]: read a byte at a time, never unpacked on the host
    if 8 * stacked.shape[2] < tokens or mask_set_past(stacked, tokens):
        raise ValueError("kept rows do not fit their positions")
    per_head = mask_count(stacked)
    if not torch.equal(per_head, torch.stack(counts).long()):
        raise ValueError("kept bits do not match the counts per head")
    rows = per_head.sum(dim=1).tolist()
    for index, count in enumerate(rows):
        _check_rows(tensors, form, index, count)
    return [LayerCounts(count) for count in rows]


def kept_rows_on_device(rows: dict[str, torch.Tensor], count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(head, position) of each stored row, as head_budget.kept_rows gives them, computed where `rows` are
    from `count` (the host's check) instead of a data-dependent size."""
    counts = rows["counts"].long()
    if "kept" in rows:
        found = torch.nonzero_static(unpack_mask(rows["kept"]), size=count)
        return found[:, 0], found[:, 1]
    heads = torch.arange(len(counts), device=counts.device)
    return torch.repeat_interleave(heads, counts, output_size=count), rows["index"].long()


@torch.inference_mode()
def decode_layer_into(tensors: dict[str, torch.Tensor], form: StoredForm, index: int, counts: LayerCounts,
                      keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, bias_buffer: torch.Tensor) -> None:
    """Layer `index`'s stored tensors (on the device, checked on the host by `check_layer`) decoded into
    zeroed dense [heads, tokens, dim] `keys` / `values` (a reserved cache's rows), its attention bias into
    `bias` ([heads, tokens] float32: -inf evicted, log(votes)) and the first columns of `bias_buffer` (the
    attention's buffer in the cache's dtype, zero past the history)."""
    decoded = decoded_layer(tensors, form, index)
    rows = {name: decoded[f"{index}.{name}"] for name in _ROWS if f"{index}.{name}" in decoded}
    heads, positions = kept_rows_on_device(rows, counts.rows)
    keys[heads, positions] = decoded[f"{index}.k"].to(keys.dtype)
    values[heads, positions] = decoded[f"{index}.v"].to(values.dtype)
    votes = rows.get("votes")
    bias.fill_(-torch.inf)
    bias[heads, positions] = torch.zeros(counts.rows, device=bias.device) if votes is None else votes.float().log()
    bias_buffer[:, : bias.shape[1]] = bias


def _signature(info: dict | None) -> tuple:
    """What must agree for layers' tensors to decode as one: everything but their row counts."""
    if info is None:
        return ()
    precise = info.get("precise")
    return (tuple(sorted((k, str(v)) for k, v in info.items() if k not in ("shape", "precise"))),
            None if precise is None else precise["group_size"])


def batchable(tensors: dict[str, torch.Tensor], form: StoredForm, layers: range) -> bool:
    """Whether `layers` decode as one (`decode_layers_into`): the same codec settings and the same kind of
    row bookkeeping in every layer, and rows grouped per token (a per-channel key layout pads each layer)."""
    quant = form.codec or {"tensors": {}}
    for role in ("k", "v"):
        infos = [quant["tensors"].get(f"{index}.{role}") for index in layers]
        if any(info is not None and info.get("axis") for info in infos) or len({_signature(i) for i in infos}) > 1:
            return False
        for part in ("precise_mask", "precise_rows", "exact"):
            if len({f"{index}.{role}.{part}" in tensors for index in layers}) > 1:
                return False
    return all(len({f"{index}.{part}" in tensors for index in layers}) == 1 for part in ("kept", "index", "votes"))


def _prefix(values: list[int]) -> list[int]:
    return [sum(values[:j]) for j in range(len(values))]


def group_plan(tensors: dict[str, torch.Tensor], form: StoredForm, layers: range) -> dict[str, torch.Tensor]:
    """On the host: the few numbers per layer `decode_layers_into` needs (where each layer's rows start, its
    8-bit and exact row counts, where its mask's bits start), one small tensor per role, named "plan.<role>":
    they travel to the device in the group's one copy instead of a copy of their own each."""
    quant, plan = form.codec, {}
    for role in ("k", "v"):
        names = [f"{index}.{role}" for index in layers]
        infos = [None if quant is None else quant["tensors"].get(name) for name in names]
        if infos[0] is None:
            continue
        rows = [int(info["shape"][0]) for info in infos]
        precise = [int(info["precise"]["rows"]) if info.get("precise") else 0 for info in infos]
        exact = [len(tensors[f"{name}.exact_rows"]) if f"{name}.exact_rows" in tensors else 0 for name in names]
        mask_bits = [8 * len(tensors[f"{name}.precise_mask"]) if f"{name}.precise_mask" in tensors else 0
                     for name in names]
        plan[f"plan.{role}"] = torch.tensor([_prefix(rows), precise, exact, _prefix(mask_bits)], dtype=torch.long)
    return plan


def _cat(tensors: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    return torch.cat([tensors[name].reshape(-1, *tensors[name].shape[1:]) for name in names])


def _rows_by_number(numbers: torch.Tensor, counts: torch.Tensor, total: int, row_starts: torch.Tensor) -> torch.Tensor:
    """Row numbers within each layer (concatenated, `counts` per layer) as numbers in the concatenated rows."""
    layer_of = torch.repeat_interleave(torch.arange(len(counts), device=numbers.device), counts, output_size=total)
    return numbers.long() + row_starts[layer_of]


def _rows_by_mask(masks: list[torch.Tensor], count: int, bit_starts: torch.Tensor,
                  row_starts: torch.Tensor) -> torch.Tensor:
    """The rows the per-layer bit masks mark (each covering its layer's rows, padded to whole bytes with
    zeros: check_layer read them), as numbers in the concatenated rows."""
    found = torch.nonzero_static(unpack_mask(torch.cat(masks)), size=count)[:, 0]
    layer = torch.searchsorted(bit_starts, found, right=True) - 1
    return found - bit_starts[layer] + row_starts[layer]


def _decode_role(tensors: dict[str, torch.Tensor], quant: dict | None, layers: range, role: str) -> torch.Tensor:
    """Every layer's `role` ("k" or "v") rows, concatenated, decoded as codec.decode decodes each layer's;
    `tensors` holds the group's plan (`group_plan`)."""
    names = [f"{index}.{role}" for index in layers]
    infos = [None if quant is None else quant["tensors"].get(name) for name in names]
    if infos[0] is None:  # stored as they are
        return _cat(tensors, names)
    info, device = infos[0], tensors[names[0] + ".codes"].device
    dtype, dim = codecs.DTYPES[info["dtype"]], int(info["shape"][-1])
    row_starts, precise_counts, exact_counts, bit_starts = tensors[f"plan.{role}"]
    rows = sum(int(i["shape"][0]) for i in infos)
    precise = sum(int(i["precise"]["rows"]) if i.get("precise") else 0 for i in infos)

    def dequantized(prefix: str, num_rows: int, bits: int, group_size: int) -> torch.Tensor:
        parts = [_cat(tensors, [f"{name}{prefix}.{part}" for name in names]) for part in ("codes", "scale")]
        zero = None if info.get("symmetric") else _cat(tensors, [f"{name}{prefix}.zero" for name in names])
        return dequantize(Quantized(parts[0].reshape(-1), parts[1], zero, bits, (num_rows, dim), 1, group_size, dtype))

    values = dequantized("", rows - precise, int(info["bits"]), math.gcd(int(info["group_size"]), dim))
    if precise:
        if f"{names[0]}.precise_mask" in tensors:
            high_rows = _rows_by_mask([tensors[f"{name}.precise_mask"] for name in names], precise, bit_starts,
                                      row_starts)
        else:
            high_rows = _rows_by_number(_cat(tensors, [f"{name}.precise_rows" for name in names]), precise_counts,
                                        precise, row_starts)
        full = torch.empty(rows, dim, dtype=dtype, device=device)
        rest = torch.ones(rows, dtype=torch.bool, device=device).index_fill_(0, high_rows, False)
        full[torch.nonzero_static(rest, size=rows - precise)[:, 0]] = values
        full[high_rows] = dequantized(".precise", precise, 8, int(info["precise"]["group_size"]))
        values = full
    if "rotation" in info:
        values = (values.float() @ rotation(dim, int(info["rotation"]), device).T).to(dtype)
    if info.get("exact"):
        total = sum(len(tensors[f"{name}.exact_rows"]) for name in names)
        exact_rows = _rows_by_number(_cat(tensors, [f"{name}.exact_rows" for name in names]), exact_counts, total,
                                     row_starts)
        values = values.contiguous()
        values[exact_rows] = _cat(tensors, [f"{name}.exact" for name in names]).to(dtype)
    return values


@torch.inference_mode()
def decode_layers_into(tensors: dict[str, torch.Tensor], form: StoredForm, layers: range, counts: list[LayerCounts],
                       keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, bias_buffer: torch.Tensor) -> None:
    """`decode_layer_into` for consecutive `layers` at once (`batchable` ones): one dequantization per role
    and one scatter for all of them, so a GPU runs a few kernels per group of layers instead of a few dozen
    per layer. `tensors` holds the group's plan too (`group_plan`). `keys` / `values`: the cache's stacked [layers, heads, >= tokens, dim] buffers (KVCache
    .reserve_stacked), `bias` [layers, heads, tokens] float32 and `bias_buffer` [layers, heads, width]."""
    tokens, heads = bias.shape[2], bias.shape[1]
    total = sum(counts[index].rows for index in layers)
    first, chosen = layers[0], slice(layers[0], layers[-1] + 1)
    quant = form.codec
    if f"{first}.kept" in tensors:
        found = torch.nonzero_static(unpack_mask(_cat(tensors, [f"{i}.kept" for i in layers])).view(len(layers), heads, -1),
                                     size=total)
        layer_of, head_of, positions = found[:, 0], found[:, 1], found[:, 2]
    else:
        per_head = _cat(tensors, [f"{i}.counts" for i in layers]).long()
        device = per_head.device
        entry = torch.repeat_interleave(torch.arange(len(per_head), device=device), per_head, output_size=total)
        layer_of, head_of = entry // heads, entry % heads
        positions = _cat(tensors, [f"{i}.index" for i in layers]).long()
    layer_of = layer_of + first
    keys[chosen, :, :tokens].zero_()
    values[chosen, :, :tokens].zero_()
    keys[layer_of, head_of, positions] = _decode_role(tensors, quant, layers, "k").to(keys.dtype)
    values[layer_of, head_of, positions] = _decode_role(tensors, quant, layers, "v").to(values.dtype)
    bias[chosen].fill_(-torch.inf)
    votes = f"{first}.votes" in tensors
    bias[layer_of, head_of, positions] = (_cat(tensors, [f"{i}.votes" for i in layers]).float().log() if votes
                                          else torch.zeros(total, device=bias.device))
    bias_buffer[chosen, :, :tokens] = bias[chosen]
