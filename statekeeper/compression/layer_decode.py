"""One layer of a per-head compressed blob (compression/head_budget.py, any codec) decoded wherever its
bytes are, without the host waiting for the device: a GPU restore copies a layer's stored tensors (codes,
scales, kept-row bits) as they are stored and decodes them on the device (statekeeper/device_restore.py).

What would make the host wait on a GPU (a data-dependent row count: `nonzero`, a check read back with
`bool(...)`) is split off: `check_layer` runs the CPU restore's checks on the host's copy of the blob first
and returns the row counts, and `decode_layer_into` then needs no value from the device (`nonzero_static`
with the counts the host read). The torch reference is the CPU restore itself (codec.decode, then
head_budget.scatter_layer and bias_of); the GPU suite compares the two."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.quant import unpack_mask
from statekeeper.compression import codec as codecs
from statekeeper.compression.form import StoredForm
from statekeeper.compression.head_budget import kept_rows

_ROWS = ("index", "kept", "counts", "votes")


@dataclass(frozen=True, slots=True)
class LayerCounts:
    rows: int  # kept (head, position) entries: rows of K and of V


def layer_names(tensors: dict[str, torch.Tensor], index: int) -> list[str]:
    prefix = f"{index}."
    return [name for name in tensors if name.startswith(prefix)]


def layer_quant(form: StoredForm, index: int) -> dict | None:
    """The codec description of layer `index`'s tensors alone (codec.decode decodes each on its own)."""
    quant = form.codec
    if quant is None:
        return None
    prefix = f"{index}."
    return quant | {"tensors": {name: info for name, info in quant["tensors"].items() if name.startswith(prefix)}}


def check_layer(tensors: dict[str, torch.Tensor], form: StoredForm, index: int, heads: int) -> LayerCounts:
    """On the host: ValueError unless layer `index` of the blob restores into `heads` heads of
    `form.num_tokens` positions (the checks the CPU restore makes, on the row bookkeeping and the codec's
    masks, which are small), and the counts the device decode needs."""
    tokens = form.num_tokens or 0
    rows = {name: tensors[f"{index}.{name}"] for name in _ROWS if f"{index}.{name}" in tensors}
    if "counts" not in rows or len(rows["counts"]) != heads:
        raise ValueError(f"layer {index}: kept rows for {heads} heads expected")
    _, positions = kept_rows(rows)
    if len(positions) and int(positions.max()) >= tokens:
        raise ValueError(f"layer {index}: kept rows do not fit their positions")
    quant = layer_quant(form, index)
    for name in (f"{index}.k", f"{index}.v"):
        info = (quant or {"tensors": {}})["tensors"].get(name)
        stored_rows = tensors[name].shape[0] if info is None else int(info["shape"][0])
        if stored_rows != len(positions):
            raise ValueError(f"{name}: {stored_rows} rows for {len(positions)} kept entries")
        if info is not None and info.get("precise") and f"{name}.precise_mask" in tensors:
            codecs.check_precise(name, unpack_mask(tensors[f"{name}.precise_mask"]), len(positions),
                                 int(info["precise"]["rows"]))
    return LayerCounts(len(positions))


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
    own = {name: tensor for name, tensor in tensors.items() if name.startswith(f"{index}.")}
    quant = layer_quant(form, index)
    decoded = own if quant is None else codecs.decode(own, quant)
    rows = {name: decoded[f"{index}.{name}"] for name in _ROWS if f"{index}.{name}" in decoded}
    heads, positions = kept_rows_on_device(rows, counts.rows)
    keys[heads, positions] = decoded[f"{index}.k"].to(keys.dtype)
    values[heads, positions] = decoded[f"{index}.v"].to(values.dtype)
    votes = rows.get("votes")
    bias.fill_(-torch.inf)
    bias[heads, positions] = torch.zeros(counts.rows, device=bias.device) if votes is None else votes.float().log()
    bias_buffer[:, : bias.shape[1]] = bias
