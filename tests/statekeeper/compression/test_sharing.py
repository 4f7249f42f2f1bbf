import torch

from statekeeper.compression.attention_stats import AttentionStats
from statekeeper.compression.sharing import CrossLayerSharing, krul_fixed_pairs, krul_pairs, minicache_pairs


def _stats(ir, distance):
    stats = AttentionStats(len(ir))
    stats.ir_mass = torch.tensor(ir, dtype=torch.float64)
    stats.ir_rows = torch.ones(len(ir), dtype=torch.float64)
    stats.sq_distance = torch.tensor(distance, dtype=torch.float64) ** 2
    stats.distance_rows = 1
    return stats


def test_minicache_takes_adjacent_pairs_from_the_end():
    assert minicache_pairs(10, 0.4) == [(8, 9), (6, 7)]


def test_krul_excludes_non_ir_layers_and_takes_closest_disjoint_pairs():
    ir = [0.1, 0.9, 0.9, 0.9, 0.9, 0.2]
    d = torch.full((6, 6), 5.0)
    d[1, 3] = d[3, 1] = 1.0  # closest
    d[3, 4] = d[4, 3] = 1.5  # shares layer 3: skipped
    d[2, 4] = d[4, 2] = 2.0
    d[0, 1] = d[1, 0] = 0.1  # layer 0 is not I-R
    assert krul_pairs(_stats(ir, d.tolist()), ratio=0.7, gamma=0.6) == [(1, 3), (2, 4)]
    assert krul_pairs(_stats(ir, d.tolist()), ratio=0.34, gamma=0.6) == [(1, 3)]


def test_krul_fixed_uses_adjacent_ir_layers_from_the_bottom():
    ir = [0.1, 0.9, 0.9, 0.2, 0.9, 0.9, 0.9, 0.9]
    d = torch.zeros(8, 8).tolist()
    assert krul_fixed_pairs(_stats(ir, d), ratio=0.5, gamma=0.6) == [(1, 2), (4, 5)]


def test_sharing_values_only_leaves_keys_untouched_and_saves_bytes():
    torch.manual_seed(0)
    layers = [(torch.randn(2, 30, 16), torch.randn(2, 30, 16)) for _ in range(4)]
    method = CrossLayerSharing("minicache", "minicache", ratio=0.5, retain_angle=1.0)
    compressed = method.compress(layers)
    assert compressed.form.pairs == ((2, 3),)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(layers, compressed.layers))
    assert not torch.equal(compressed.layers[2][1], layers[2][1])
    full = sum(k.nbytes + v.nbytes for k, v in layers)
    assert compressed.stored_bytes == full - 2 * layers[2][1].nbytes + 2 * 30 * (16 + 2) * 4 + 2 * 30


def test_stored_tensors_rebuild_the_same_layers_through_a_blob():
    from statekeeper.compression import restore_state
    from storage import serialization

    torch.manual_seed(0)
    layers = [(torch.randn(2, 30, 16), torch.randn(2, 30, 16)) for _ in range(4)]
    compressed = CrossLayerSharing("minicache-kv", "minicache", ratio=0.5, share_keys=True).compress(layers)
    blob = serialization.encode_tensors(compressed.tensors, "m", list(range(30)), 30, compressed.meta)
    header, tensors = serialization.decode_tensors(blob, "m", list(range(30)))
    assert header.payload_bytes >= compressed.stored_bytes and len(blob) < compressed.stored_bytes + 8192
    rebuilt, _ = restore_state(tensors, header.meta, 4)
    for (k1, v1), (k2, v2) in zip(compressed.layers, rebuilt):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_damage_selection_takes_least_damaging_disjoint_pairs_up_to_the_ratio():
    from statekeeper.compression.sharing import least_damage_pairs

    ranking = [(4, 5), (5, 6), (0, 1), (8, 9), (2, 3)]
    assert least_damage_pairs(ranking, ratio=0.6, num_layers=10) == [(0, 1), (4, 5), (8, 9)]
    assert least_damage_pairs(ranking, ratio=0.2, num_layers=10) == [(4, 5)]
    method = CrossLayerSharing("damage", "damage", ratio=0.4, ranking=ranking)
    assert method.select(None, 10) == [(0, 1), (4, 5)]


def test_restore_rebuilds_the_attended_layers_from_the_stored_form():
    torch.manual_seed(0)
    layers = [(torch.randn(2, 30, 16), torch.randn(2, 30, 16)) for _ in range(4)]
    compressed = CrossLayerSharing("kv", "minicache", ratio=0.5, share_keys=True).compress(layers)
    assert all(torch.equal(a, b) for pair, rebuilt in zip(compressed.layers, compressed.restore())
               for a, b in zip(pair, rebuilt))
