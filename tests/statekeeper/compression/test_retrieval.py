"""HeteroCache's retrieval (compression/retrieval.py, compression/hetero.py): a pivot whose attention moves to
an early part of the history its satellite evicted makes the satellite get exactly those rows back, exact;
a pivot that keeps attending where it did brings nothing; and a working set on a real (tiny) model attends
to no more than its live share before retrieval, every full head exact."""

import pytest
import torch

from statekeeper.compression import by_name
from statekeeper.compression.head_profile import HeadProfile
from statekeeper.compression.retrieval import DriftMonitor
from statekeeper.compression.taxonomy import Cluster, HeadTaxonomy, build_taxonomy
from statekeeper.evaluation.teacher_forcing import (build_state, compare_continuation, log_probs, restored,
                                                   retrieving_log_probs)
from statekeeper.kv_cache import KVCache

HISTORY, DIM = 64, 8


def _taxonomy(window=4) -> HeadTaxonomy:
    """One layer, two KV heads: head 0 the pivot, head 1 its satellite."""
    return HeadTaxonomy([[0.9, 0.9]], [[[1, 0.9], [0.9, 1]]], [["pivot", "satellite"]], [Cluster(0, 0, [1])],
                        [[1.0, 0.25]], 0.625, k_fraction=4 / HISTORY, pool=1, window=window)


def _layers() -> list:
    """Keys that a query along dimension 0 finds at positions 2-5 (the early fact), along dimension 1 at
    positions 50-53 (where the history ended); both heads alike (the satellite attends as its pivot)."""
    keys = torch.zeros(2, HISTORY, DIM)
    keys[:, 2:6, 0] = 4.0
    keys[:, 50:54, 1] = 4.0
    values = torch.randn(2, HISTORY, DIM)
    return [(keys, values)]


def _queries(dimension: int, kv_heads: int = 2, groups: int = 2, window: int = 4) -> torch.Tensor:
    queries = torch.zeros(kv_heads * groups, window, DIM)
    queries[:, :, dimension] = 4.0
    return queries


def test_a_pivot_drifting_to_an_evicted_early_fact_brings_its_satellite_those_rows():
    layers = _layers()
    monitor = DriftMonitor.start(_taxonomy(), layers, [_queries(1)], scaling=1.0)
    assert sorted(monitor.baseline[(0, 0)].tolist()) == [50, 51, 52, 53]
    monitor.observe(0, _queries(1)[None], None, 1.0)  # still attending where the history ended: no drift
    assert monitor.check(layers) == [] and monitor.counters.drift_events == 0
    monitor.observe(0, _queries(0)[None], None, 1.0)  # the question asks about the early fact
    (retrieval,) = monitor.check(layers)
    assert (retrieval.layer, retrieval.head) == (0, 1) and sorted(retrieval.positions.tolist()) == [2, 3, 4, 5]
    assert monitor.counters.drift_events == 1 and monitor.counters.rows == 4
    # The satellite evicted them: after the write it attends to them, exact.
    cache = KVCache.from_layers([(torch.zeros_like(layers[0][0]), torch.zeros_like(layers[0][1]))],
                                torch.device("cpu"), [torch.full((2, HISTORY), -torch.inf)])
    positions = retrieval.positions
    cache.write_rows([(0, 1, positions, layers[0][0][1, positions], layers[0][1][1, positions])])
    keys, values = cache.export_layers()[0]
    assert torch.equal(values[1, positions], layers[0][1][1, positions])
    assert torch.isfinite(cache.head_bias[0][1]).sum() == 4 and torch.isinf(cache.head_bias[0][0]).all()
    monitor.observe(0, _queries(0)[None], None, 1.0)  # the same drift again: its baseline moved, nothing new
    assert monitor.check(layers) == [] and monitor.counters.drift_events == 1


@pytest.fixture(scope="module")
def hetero_profile(tiny_worker) -> HeadProfile:
    """A taxonomy for the tiny model (4 layers, 2 KV heads): in each layer head 0 is a pivot with head 1 as
    its satellite, at a live share of 0.6."""
    layers = tiny_worker.num_layers
    taxonomy = build_taxonomy([[0.9, 0.6]] * layers, [[[1, 0.9], [0.9, 1]]] * layers, live_rho=0.6,
                              k_fraction=0.1, pool=3, window=8)
    return HeadProfile(tiny_worker.fingerprint, "kvzip", 2.0, 0, {}, {}, {}, {}, taxonomy=taxonomy.to_dict())


def test_a_working_set_keeps_full_heads_exact_within_its_live_share(tiny_worker, hetero_profile):
    tokens = list(range(5, 205))
    state = build_state(tiny_worker, tokens)
    state.stats.reconstruction = tiny_worker.reconstruction_scores(state.cache, tokens)
    method = by_name("hetero@0.3+int4", profile=hetero_profile)
    exact = state.cache.export_layers()
    compressed = method.compress(exact, state.stats)
    working = compressed.working_set
    assert working.live_entries <= 0.6 * working.entries + 4 * 2 * (4 + 32)  # sinks and recent tokens beyond
    for layer, (keys, _) in enumerate(compressed.layers):
        assert torch.equal(keys[0], exact[layer][0][0].to(keys.dtype))  # the pivot: exact, all of it
        assert torch.isfinite(compressed.head_bias[layer][0]).all()
    fast = by_name("kvzip-calibrated@0.3+int4", profile=HeadProfile("m", "kvzip", 2.0, 0, {"0.3": [[0.3, 0.3]] * 4},
                                                                     {}, {}, {}))
    assert compressed.stored_bytes < fast.compress(exact, state.stats).stored_bytes  # satellites keep less
    with pytest.raises(ValueError, match="taxonomy"):
        by_name("hetero@0.3", profile=None)


def test_teacher_forcing_on_a_working_set_checks_for_drift_where_the_service_would(tiny_worker, hetero_profile,
                                                                                   monkeypatch):
    history, continuation = list(range(5, 205)), list(range(300, 340))
    state = build_state(tiny_worker, history[:-1])
    state.stats.reconstruction = tiny_worker.reconstruction_scores(state.cache, history[:-1])
    method = by_name("hetero@0.3", profile=hetero_profile)
    checks = []
    monitor_check = DriftMonitor.check
    monkeypatch.setattr(DriftMonitor, "check", lambda self, layers: checks.append(1) or monitor_check(self, layers))
    totals = compare_continuation(tiny_worker, history, continuation, [(10, 40)], method, state)
    # Before the prompt's last token (fed 10), then after every 8 answer tokens: 18, 26, 34 (41 fed in all).
    assert len(checks) == 4
    assert totals.tokens == 30 and 0 < totals.live_fraction <= 0.75
    lossless = compare_continuation(tiny_worker, history, continuation, [(10, 40)], by_name("none"), state)
    assert lossless.live_fraction == 1.0 and lossless.top1_agreement == 1.0


def test_an_exact_prompt_reads_the_whole_history_and_the_reply_only_the_working_set(tiny_worker, hetero_profile):
    history, continuation, answer_start = list(range(5, 205)), list(range(300, 340)), 10
    state = build_state(tiny_worker, history[:-1])
    state.stats.reconstruction = tiny_worker.reconstruction_scores(state.cache, history[:-1])
    exact = state.cache.export_layers()
    fed = history[-1:] + continuation
    prompt = fed[: answer_start + 1]  # its last token predicts the answer's first
    full_cache = KVCache.from_layers(exact, tiny_worker.device)
    full_prompt = log_probs(tiny_worker, full_cache, prompt)
    full_reply = log_probs(tiny_worker, full_cache, fed[answer_start + 1 :])
    rows, caches = {}, {}
    for name in ("hetero-global@0.3", "hetero-global-prompt@0.3"):
        compressed = by_name(name, profile=hetero_profile).compress(exact, state.stats)
        caches[name], _ = restored(tiny_worker, compressed)
        rows[name] = retrieving_log_probs(tiny_worker, caches[name], fed, answer_start, compressed.working_set)
    exact_prompt = rows["hetero-global-prompt@0.3"]
    assert torch.equal(exact_prompt[: len(prompt)], full_prompt)  # the same forwards on the same rows
    assert not torch.equal(rows["hetero-global@0.3"][: len(prompt) - 1], full_prompt[:-1])
    assert not torch.equal(exact_prompt[len(prompt) :], full_reply)  # the reply attends the working set only
    bias = caches["hetero-global-prompt@0.3"].head_bias
    attended = sum(int(torch.isfinite(b).sum()) for b in bias)
    assert attended < 0.75 * sum(b.numel() for b in bias)


def test_a_static_working_set_is_never_checked_and_keeps_the_bias_its_restore_built(tiny_worker, hetero_profile,
                                                                                    monkeypatch):
    history, continuation, answer_start = list(range(5, 205)), list(range(300, 340)), 10
    state = build_state(tiny_worker, history[:-1])
    state.stats.reconstruction = tiny_worker.reconstruction_scores(state.cache, history[:-1])
    exact = state.cache.export_layers()
    fed = history[-1:] + continuation
    checks = []
    monkeypatch.setattr(DriftMonitor, "check", lambda self, layers: checks.append(1) or [])
    rows, caches, compressed = {}, {}, {}
    for name in ("hetero-global-prompt@0.3", "hetero-global-prompt-static@0.3"):
        compressed[name] = by_name(name, profile=hetero_profile).compress(exact, state.stats)
        caches[name], _ = restored(tiny_worker, compressed[name])
        rows[name] = retrieving_log_probs(tiny_worker, caches[name], fed, answer_start, compressed[name].working_set)
    assert len(checks) == 4  # the retrieving one only: after the prompt, then every 8 answer tokens
    # Nothing retrieved either way (the check finds nothing): the same forwards on the same rows and bias.
    assert torch.equal(rows["hetero-global-prompt@0.3"], rows["hetero-global-prompt-static@0.3"])
    static = compressed["hetero-global-prompt-static@0.3"]
    assert all(torch.equal(after, before) for after, before in zip(caches["hetero-global-prompt-static@0.3"].head_bias,
                                                                   static.head_bias))


def test_an_exact_prompt_needs_exact_rows_in_the_working_set(tiny_worker, hetero_profile):
    tokens = list(range(5, 205))
    state = build_state(tiny_worker, tokens)
    state.stats.reconstruction = tiny_worker.reconstruction_scores(state.cache, tokens)
    method = by_name("hetero@0.3+int4", profile=hetero_profile)
    method.prompt_exact = True
    with pytest.raises(ValueError, match="exact rows"):
        method.compress(state.cache.export_layers(), state.stats)
