import dataclasses

import pytest
import torch

from statekeeper.chat import ChatFormatter
from statekeeper.compression import by_name
from statekeeper.evaluation.fidelity import evaluate, format_table, recall_continuation, run_needle
from statekeeper.evaluation.needles import make_needles
from statekeeper.evaluation.recall import make_recall_cases
from statekeeper.evaluation.teacher_forcing import compare_continuation, compare_rows, sharegpt_cases

FILLER = [[("user", "Tell me about the history of Rome."), ("assistant", "Rome was not built in a day. " * 3)] * 6]
SHORT_FILLER = [[("user", "Hi there."), ("assistant", "Hello!")] * 30]
RECALL_FILLER = [[("user", "Tell me about Greece."), ("assistant", "Rome was not built in a day. " * 3)] * 8]


@pytest.fixture
def formatter(tiny_worker):
    return ChatFormatter(tiny_worker.tokenizer)


def test_lossless_state_has_perfect_fidelity_and_lossy_ones_do_not(tiny_worker, formatter):
    eos = tiny_worker.tokenizer.eos_token_id
    (case,) = sharegpt_cases(formatter, FILLER, target_tokens=60, count=1, end_of_turn=eos)
    assert case.spans and case.continuation[case.spans[0][1] - 1] == eos
    full = compare_continuation(tiny_worker, case.history, case.continuation, case.spans, by_name("none"))
    assert full.top1_agreement == 1.0 and full.mean_kl == 0.0 and full.perplexity_ratio == 1.0
    assert full.stored_bytes == full.full_bytes
    int4 = compare_continuation(tiny_worker, case.history, case.continuation, case.spans, by_name("int4"))
    assert int4.mean_kl > 0 and int4.stored_bytes < full.stored_bytes / 5


def test_a_disagreement_is_recorded_with_full_kvs_margin_a_tie_at_zero():
    """Rows predict tokens 1..3 of a 4-token continuation; the scored span is all of them."""
    full = torch.log_softmax(torch.tensor([[3.0, 3.0, 0.0], [0.0, 2.5, 2.0], [1.0, 0.0, 0.0]]), dim=-1)
    compressed = torch.log_softmax(torch.tensor([[0.0, 3.0, 0.0], [0.0, 1.0, 2.0], [2.0, 0.0, 0.0]]), dim=-1)
    totals = compare_rows(full, compressed, [0, 1, 2], [(0, 3)])
    assert (totals.tokens, totals.agreements) == (3, 1)
    # Row 0: full KV's top two tie (argmax took token 0); row 1: token 1 led by 0.5.
    assert totals.flipped_margins == pytest.approx([0.0, 0.5])


def test_needles_reach_the_target_length_and_run(tiny_worker, formatter):
    needles = make_needles(2, iter(SHORT_FILLER * 2), formatter, target_tokens=120)
    assert len(needles) == 2 and needles[0].fact in needles[0].history[1]["content"]
    result = run_needle(tiny_worker, formatter, needles[0], by_name("none"))
    assert result.fact_logprob < 0 and result.history_tokens >= 96
    assert result.is_correct == (needles[0].fact.lower() in result.answer.lower())


def test_evaluate_rows(tiny_worker, monkeypatch):
    import statekeeper.evaluation.datasets as datasets

    monkeypatch.setattr(datasets, "sharegpt_conversations", lambda min_turns: iter(FILLER * 2 + SHORT_FILLER * 4))
    names = ["none", "int8", "kvzip-merge@0.5+int8", "expected-uniform@0.5"]
    rows = evaluate(tiny_worker, [by_name(name) for name in names], [80], 2, 2, log=lambda line: None)
    assert [r["method"] for r in rows] == names
    assert rows[0]["top1_agreement"] == 1.0 and rows[1]["bytes_per_token"] < rows[0]["bytes_per_token"]
    assert rows[2]["bytes_per_token"] < 0.2 * rows[0]["bytes_per_token"]
    # KVzip's compression time includes the reconstruction pass; every row reports a restore time.
    assert rows[2]["compress_ms_mean"] > rows[3]["compress_ms_mean"] and all(r["restore_ms_mean"] > 0 for r in rows)


@pytest.mark.parametrize("name", ["minicache", "krul_fixed", "krul", "krul-kv", "h2o", "krul_fixed/expected@0.5+int4-s1"])
def test_compression_methods_run_through_the_harness(tiny_worker, formatter, name):
    from statekeeper.evaluation.teacher_forcing import build_state

    eos = tiny_worker.tokenizer.eos_token_id
    (case,) = sharegpt_cases(formatter, FILLER, target_tokens=60, count=1, end_of_turn=eos)
    state = build_state(tiny_worker, case.history[:-1])
    method = by_name(name, ratio=0.5, gamma=0.0)  # tiny model: every layer counts as I-R
    if name == "h2o":
        method.keep_fraction = 0.5
    totals = compare_continuation(tiny_worker, case.history, case.continuation, case.spans, method, state)
    assert totals.stored_bytes < totals.full_bytes and totals.tokens > 0 and totals.mean_kl >= 0


def test_by_name_reads_parts_and_ratio_and_damage_needs_a_ranking():
    method = by_name("krul-kv@0.4")
    assert (method.name, method.ratio, method.share_keys, method.share_values) == ("krul-kv@0.4", 0.4, True, True)
    with pytest.raises(ValueError, match="damage ranking"):
        by_name("damage-kv")
    damage = by_name("damage-kv@0.5", rankings={"kv": [(2, 3), (0, 1)]})
    assert damage.select(None, 4) == [(2, 3)]
    with pytest.raises(ValueError):
        by_name("krul-x")


def test_a_recall_case_scores_exactly_the_restating_answer(tiny_worker, formatter):
    eos = tiny_worker.tokenizer.eos_token_id
    (case,) = make_recall_cases(1, iter(RECALL_FILLER), formatter, target_tokens=400, seed=3)
    continuation = recall_continuation(formatter, case, eos)
    assert continuation.history == formatter.append_turns([], [], case.history, eos)[0]
    ((begin, end),) = continuation.spans
    assert end == len(continuation.continuation) and continuation.continuation[end - 1] == eos
    assert formatter.decode(continuation.continuation[begin : end - 1]) == case.answer
    assert case.question in formatter.decode(continuation.continuation[:begin])


def test_recall_rows_score_the_answers_against_the_full_kv(tiny_worker, monkeypatch):
    import statekeeper.evaluation.datasets as datasets
    import statekeeper.evaluation.fidelity as fidelity

    monkeypatch.setattr(datasets, "sharegpt_conversations", lambda min_turns: iter(RECALL_FILLER * 4))
    monkeypatch.setattr(fidelity, "RECALL", dataclasses.replace(fidelity.RECALL, skip=0))
    full, int4 = evaluate(tiny_worker, [by_name("none"), by_name("int4")], [400], 0, 0, 2, log=lambda line: None)
    assert full["conversations"] == full["needles"] == 0 and full["recall_conversations"] == 2
    assert full["recall_tokens"] == int4["recall_tokens"] > 0 and 320 <= full["recall_history_tokens_mean"] <= 520
    assert full["recall_top1_agreement"] == 1.0 and full["recall_mean_kl"] == 0.0
    assert full["recall_answer_logprob_mean"] == full["recall_answer_logprob_full_mean"] < 0
    assert int4["recall_answer_logprob_full_mean"] == full["recall_answer_logprob_full_mean"]
    assert full["recall_answer_hits"] == full["recall_answer_hits_full"] == int4["recall_answer_hits_full"]
    assert int4["recall_mean_kl"] > 0 and int4["recall_bytes_per_token"] < full["recall_bytes_per_token"] / 5
    table = format_table([full, int4])
    assert table.startswith("Recall of early facts") and "| ~400 (" in table and "needles" not in table


def test_held_out_rows_use_other_facts_and_chain_fillers_to_the_length(tiny_worker, monkeypatch):
    """One short filler conversation per case is not enough for 600 tokens: the held-out cases chain them."""
    import statekeeper.evaluation.datasets as datasets
    import statekeeper.evaluation.fidelity as fidelity
    from statekeeper.evaluation.recall import HELDOUT_KINDS

    short = [RECALL_FILLER[0][:4]]  # two exchanges, ~200 tokens
    monkeypatch.setattr(datasets, "sharegpt_conversations", lambda min_turns: iter(short * 40))
    monkeypatch.setattr(fidelity, "HELDOUT", dataclasses.replace(fidelity.HELDOUT, skip=0))
    full, int4 = evaluate(tiny_worker, [by_name("none"), by_name("int4")], [600], 0, 0, 0, log=lambda line: None,
                          num_heldout=2)
    assert full["recall_conversations"] == 0 and full["heldout_conversations"] == 2
    assert 480 <= full["heldout_history_tokens_mean"] <= 780 and full["heldout_top1_agreement"] == 1.0
    assert int4["heldout_tokens"] == full["heldout_tokens"] > 0 and int4["heldout_mean_kl"] > 0
    table = format_table([full, int4])
    assert table.startswith("Held-out recall") and "Recall of early facts" not in table
    formatter = ChatFormatter(tiny_worker.tokenizer)
    (case,) = fidelity.make_recall_cases(1, iter(short * 10), formatter, 600, seed=1, kinds=HELDOUT_KINDS,
                                          chain_fillers=True)
    said = {kind[0] for kind in HELDOUT_KINDS}
    assert all(fact.said in said for fact in case.asked) and len(case.history) > 2 + len(short[0])
