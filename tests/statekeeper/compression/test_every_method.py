"""Every registered compression method × codec on the tiny model (as kvpress runs every press): the state
goes through a real blob and back, and each combination must show four things.
- Round trip: what restore_state rebuilds from the blob is, bit for bit, what the method said a restore
  gives (`Compressed.restore()`), attention bias included.
- Bytes as declared: the blob's tensors hold exactly `stored_bytes`, and the payload only adds alignment.
- Lossless methods without a codec restore the hot state exactly.
- Lossy ones stay within their stated bound: per-head eviction keeps the rows it kept bit-exact and masks
  the rest; cross-layer sharing keeps unshared layers exact and each merged row's magnitude, with its
  direction within the retain angle; a codec brings each stored tensor back within its quantization
  bound (below)."""

import math

import pytest
import torch

from statekeeper.compression import StoredForm, by_name, layer_tensors, registered, restore_state
from statekeeper.compression import codec as codecs
from statekeeper.config import CompressionConfig
from storage import serialization

TOKENS = list(range(5, 165))
# One name per registered method, built as a user would name it. The matrix below fails when a method is
# registered without one here.
EXAMPLES = {
    "none": "none", "h2o": "h2o",
    "krul": "krul@0.5", "krul_fixed": "krul_fixed-kv@0.5", "minicache": "minicache-kv@0.5", "damage": "damage@0.5",
    "snapkv": "snapkv@0.5", "expected": "expected-merge@0.5", "kvzip": "kvzip-global@0.5",
}
COMPOSED = ["minicache/expected@0.5"]  # <sharing>/<per-head> (compression/shared_heads.py)
CODECS = ["none", "int8", "int4-kc", "int4-rot-sym-s1", CompressionConfig().codec]  # the last: the default
# Below 4 bits the codec may shrink a group's range to half (kernels/quant.py CLIP_RATIOS) where that lowers
# the squared error; from 4 bits up it keeps the whole range.
LEAST_RANGE_KEPT = {2: 0.5, 3: 0.5}


@pytest.fixture(scope="module")
def state(tiny_worker):
    """The tiny model's KV of TOKENS with the attention statistics and KVzip scores the methods read."""
    cache, stats = tiny_worker.new_cache(), tiny_worker.new_stats()
    tiny_worker.prefill(cache, TOKENS, stats)
    stats.reconstruction = tiny_worker.reconstruction_scores(cache, TOKENS)
    return [(k.clone(), v.clone()) for k, v in cache.export_layers()], stats


def _build(name: str, layers: int):
    """The method as `name` says; Krul's I-R threshold at 0 so that the tiny model's layers qualify to share."""
    ranking = [(i, i + 1) for i in range(0, layers - 1)]  # damage's calibrated order, here simply adjacent
    return by_name(name, gamma=0.0, rankings={"v": ranking, "k": ranking, "kv": ranking})


def _through_a_blob(worker, compressed, layers):
    stored = compressed.tensors or layer_tensors(layers)
    blob = serialization.encode_tensors(stored, worker.fingerprint, TOKENS, len(TOKENS), compressed.meta)
    header, tensors = serialization.decode_tensors(blob, worker.fingerprint, TOKENS)
    return header, tensors, restore_state(tensors, header.meta, worker.num_layers)


def test_every_registered_method_is_in_the_matrix():
    assert set(registered()) - {""} == set(EXAMPLES)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("method", [*EXAMPLES.values(), *COMPOSED])
def test_method_and_codec(tiny_worker, state, method, codec):
    layers, stats = state
    name = method if codec == "none" else f"{method}+{codec}"
    compressed = _build(name, len(layers)).compress(layers, stats)
    header, tensors, (back, bias) = _through_a_blob(tiny_worker, compressed, layers)

    expected = compressed.restore()
    assert all(torch.equal(k, k2) and torch.equal(v, v2) for (k, v), (k2, v2) in zip(expected, back))
    if compressed.head_bias is None:
        assert bias is None
    else:
        assert all(torch.equal(b, b2) for b, b2 in zip(compressed.head_bias, bias))

    if method != "h2o":  # h2o is a mask measured in evaluation: its stored_bytes prices the kept tokens only
        assert sum(entry.nbytes for entry in header.tensors) == compressed.stored_bytes
        assert header.payload_bytes <= compressed.stored_bytes + 64 * len(header.tensors)

    plain = _build(method, len(layers)).compress(layers, stats)
    if codec == "none":
        _check_method_bound(method, plain, back, bias, layers)
    else:
        _check_codec_bound(plain.tensors or layer_tensors(layers), tensors, StoredForm.from_meta(header.meta).codec)


def _check_method_bound(method, plain, back, bias, layers):
    form = plain.form
    if form.kind == "exact":  # none, h2o: the state as it is
        assert bias is None
        assert all(torch.equal(k, k2) and torch.equal(v, v2) for (k, v), (k2, v2) in zip(layers, back))
    if form.kind in ("heads", "shared_heads"):
        paired = {i for pair in form.pairs for i in pair}
        masks = [b[:, : k.shape[1]] > float("-inf") for (k, _), b in zip(layers, bias)]
        assert 0 < sum(int(m.sum()) for m in masks) < sum(m.numel() for m in masks)  # some kept, some evicted
        for index, ((k, v), (k2, v2), b) in enumerate(zip(layers, back, bias)):
            alone = b[:, : k.shape[1]] == 0  # kept with one vote; more: KeepKV merged evicted entries in
            merged = b[:, : k.shape[1]] > 0
            if index not in paired:  # evicted entries are masked; kept ones are the hot rows
                assert torch.equal(k[alone], k2[alone]) and torch.equal(v[alone], v2[alone])
            else:
                _check_merged_rows(k[alone], k2[alone], v[alone], v2[alone], form)
            _check_votes_merged(k, k2, v, v2, merged)
    if form.kind == "sharing":
        paired = {i for pair in form.pairs for i in pair}
        assert paired  # the examples' ratios share some layers
        for index, ((k, v), (k2, v2)) in enumerate(zip(layers, back)):
            if index not in paired:
                assert torch.equal(k, k2) and torch.equal(v, v2)
            else:
                _check_merged_rows(k, k2, v, v2, form, parts=("kv"[p] for p in form.parts))


def _check_votes_merged(k, k2, v, v2, merged):
    """KeepKV: a value merged from several entries is their convex combination (no longer than the head's
    longest value), a key at most kernels/keepkv.py's _MAX_FACTOR (4) times theirs."""
    eps = torch.finfo(torch.float32).eps * k.shape[-1]
    for head in range(k.shape[0]):
        rows = merged[head]
        if rows.any():
            assert float(v2[head][rows].norm(dim=-1).max()) <= float(v[head].norm(dim=-1).max()) * (1 + eps)
            assert float(k2[head][rows].norm(dim=-1).max()) <= 4 * float(k[head].norm(dim=-1).max()) * (1 + eps)


def _check_merged_rows(k, k2, v, v2, form, parts=None):
    """A merged row keeps its magnitude (stored per row) and lies within the retain angle of the original
    (SLERP interpolates between the two layers' directions, which are at most that far apart)."""
    for part in parts or form.parts:
        original, restored = (k, k2) if part == "k" else (v, v2)
        original, restored = original.reshape(-1, original.shape[-1]).float(), restored.reshape(-1, original.shape[-1]).float()
        norms, restored_norms = original.norm(dim=-1), restored.norm(dim=-1)
        eps = torch.finfo(torch.float32).eps * original.shape[-1]  # a norm and a normalize, per element
        assert torch.allclose(restored_norms, norms, rtol=4 * eps, atol=1e-30)
        cosine = (original * restored).sum(-1) / (norms * restored_norms).clamp_min(1e-30)
        assert bool((cosine >= math.cos(0.5 * math.pi) - 4 * eps).all())  # CompressionConfig.retain_angle 0.5


def _check_codec_bound(stored, decoded_blob, quant):
    """Each tensor the codec wrote comes back within its bound; every other tensor bit-exact. For a tensor
    whose rows have L2 norm at most R, at b bits: a group's range is at most 2R (rotation is orthonormal),
    possibly shrunk to c of it (LEAST_RANGE_KEPT), so an element is off by at most (1 - c) R for the clip
    plus half a step c R / (2^b - 1), plus R 2^-9 for the fp16 scale and zero point; a row, rotated back,
    by at most sqrt(d) times that."""
    decoded = codecs.decode(dict(decoded_blob), quant)
    assert set(decoded) == {name for name, _ in stored}
    for name, original in stored:
        info = quant["tensors"].get(name)
        if info is None:
            assert torch.equal(decoded[name], original), name
            continue
        rows = original.reshape(-1, original.shape[-1]).float()
        back = decoded[name].reshape(rows.shape).float()
        bits, d = int(info["bits"]), rows.shape[-1]
        kept = LEAST_RANGE_KEPT.get(bits, 1.0)
        radius = float(rows.norm(dim=-1).max())
        bound = math.sqrt(d) * radius * ((1 - kept) + kept / (2**bits - 1) + 2**-9)
        assert float((back - rows).norm(dim=-1).max()) <= bound, name
