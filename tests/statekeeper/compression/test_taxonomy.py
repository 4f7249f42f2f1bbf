"""HeteroCache's head taxonomy (compression/taxonomy.py): star clusters of heads that attend alike, roles by
stability, live budgets by inverse stability within the live share, and its round trip through the profile."""

import json

import pytest
import torch

from statekeeper.compression.head_profile import HeadProfile
from statekeeper.compression.taxonomy import (HeadTaxonomy, attended, build_taxonomy, overlap, star_clusters,
                                              top_positions)


def test_overlap_is_the_shared_share_of_the_smaller_set():
    assert overlap(torch.tensor([1, 2, 3, 4]), torch.tensor([3, 4])) == 1.0
    assert overlap(torch.tensor([1, 2, 3, 4]), torch.tensor([4, 5, 6, 7])) == 0.25
    assert overlap(torch.tensor([], dtype=torch.long), torch.tensor([1])) == 0.0


def test_star_clustering_takes_the_most_connected_head_as_pivot():
    similar = [[1.0, 0.9, 0.6, 0.1],
               [0.9, 1.0, 0.2, 0.1],
               [0.6, 0.2, 1.0, 0.1],
               [0.1, 0.1, 0.1, 1.0]]
    assert star_clusters(similar, tau_sim=0.5) == [(0, [1, 2])]  # head 3 is like no other
    assert star_clusters(similar, tau_sim=0.95) == []


def test_roles_and_budgets_within_the_live_share():
    stability = [[0.9, 0.8, 0.2], [0.7, 0.3, 0.6]]
    pairs = [[[1, 0.8, 0.1], [0.8, 1, 0.1], [0.1, 0.1, 1]], [[1, 0.1, 0.1], [0.1, 1, 0.1], [0.1, 0.1, 1]]]
    taxonomy = build_taxonomy(stability, pairs, live_rho=0.5)
    assert taxonomy.roles == [["pivot", "satellite", "volatile"], ["anchor", "volatile", "anchor"]]
    # Full heads (a pivot, two volatile) keep everything; the other three share 0.5 * 6 - 3 = 0 entries.
    assert sum(map(sum, taxonomy.live_budgets)) == pytest.approx(3.0)
    looser = build_taxonomy(stability, pairs, live_rho=0.75)  # 1.5 heads' worth left, by 1 / stability
    budgets = looser.live_budgets
    assert sum(map(sum, budgets)) == pytest.approx(4.5)
    weights = {(0, 1): 1 / 0.8, (1, 0): 1 / 0.7, (1, 2): 1 / 0.6}
    for (layer, head), weight in weights.items():
        assert budgets[layer][head] == pytest.approx(1.5 * weight / sum(weights.values()))
    with pytest.raises(ValueError, match="live budget"):
        build_taxonomy(stability, pairs, live_rho=0.4)
    assert looser.counts() == {"pivot": 1, "satellite": 1, "anchor": 2, "volatile": 2}


def test_a_head_over_its_whole_history_hands_the_rest_on():
    """Anchors of stability 0.05, 0.5 and 0.5 sharing 1.5 heads' worth: by 1 / stability the first would get
    1.5 * 20 / 24 = 1.25, so it keeps its whole history and the other two share the 0.5 left."""
    taxonomy = build_taxonomy([[0.05, 0.5, 0.5]], [[[1, 0, 0], [0, 1, 0], [0, 0, 1]]], live_rho=1.5 / 3,
                              tau_stable=0.01)
    assert taxonomy.live_budgets[0] == pytest.approx([1.0, 0.25, 0.25])


def test_the_taxonomy_travels_in_the_head_profile_and_old_profiles_still_load():
    taxonomy = build_taxonomy([[0.9, 0.2]], [[[1, 0.9], [0.9, 1]]], live_rho=0.75)
    profile = HeadProfile("m", "kvzip", 2.0, 0, {}, {}, {}, {}, taxonomy=taxonomy.to_dict())
    loaded = HeadProfile.from_json(profile.to_json())
    assert HeadTaxonomy.from_dict(loaded.taxonomy) == taxonomy
    old = json.loads(profile.to_json())
    del old["taxonomy"]
    assert HeadProfile.from_json(json.dumps(old)).taxonomy is None
    broken = taxonomy.to_dict() | {"roles": [["pivot", "leader"]]}
    with pytest.raises(ValueError, match="role"):
        HeadTaxonomy.from_dict(broken)


def test_top_positions_follow_where_the_queries_point():
    keys = torch.zeros(2, 40, 4)
    keys[0, 10:13, 0] = 5.0  # head 0's keys at 10-12 match the query
    keys[1, 30:33, 1] = 5.0
    queries = torch.zeros(2, 3, 4)
    queries[0, :, 0] = queries[1, :, 1] = 5.0
    scores = attended(queries, keys, scaling=1.0, pool=1)
    top = top_positions(scores, k_fraction=3 / 40)
    assert sorted(top[0].tolist()) == [10, 11, 12] and sorted(top[1].tolist()) == [30, 31, 32]
