"""From how many rows the weight-only layers use the GEMM is measured on this machine
(statekeeper/dense_rows_choice.py) and applied to every such layer."""

import json

import pytest
import torch

from kernels.weight_linear import DENSE_FROM_ROWS, Int4WeightLinear, use_dense_from_rows
from statekeeper.config import WorkerConfig
from statekeeper.dense_rows_choice import ROW_COUNTS, RowTiming, choose, crossover, timings_path
from statekeeper.machine import machine_id
from statekeeper.model_loader import load_model
from statekeeper.worker import ModelWorker
from tests.conftest import MODEL_CACHE


@pytest.fixture(scope="module")
def smollm2():
    """A SmolLM2 worker of this module's own: the choice changes its layers."""
    config = WorkerConfig(model="smollm2", model_cache_dir=MODEL_CACHE)
    return ModelWorker(load_model(config.model, config.model_cache_dir), config)


def _timings(gemm_wins_from: int) -> list[dict]:
    return [{"rows": rows, "kernel_us": 10.0 * rows, "gemm_us": 10.0 * gemm_wins_from} for rows in ROW_COUNTS]


def _thresholds(worker) -> set[int]:
    return {m.dense_from_rows for m in worker.model.modules() if hasattr(m, "dense_from_rows")}


def test_the_crossover_is_where_the_gemm_stays_at_least_as_fast():
    timings = [RowTiming(rows, kernel, gemm) for rows, kernel, gemm in
               [(4, 1.0, 3.0), (8, 2.0, 1.9), (16, 4.0, 4.5), (32, 8.0, 5.0), (64, 16.0, 6.0)]]
    assert crossover(timings) == 32  # faster at 8, slower again at 16 (its padding), faster from 32 on
    assert crossover(timings[:1]) == 8  # never faster within the counts measured: past the last one


def test_a_gemm_that_is_slower_at_every_count_and_falls_further_behind_is_never_used():
    """An AMD EPYC without AVX-512 BF16 (this machine's timings, 2026-11-26): the bfloat16 GEMM is emulated and
    2.6x slower at every count, and its time grows faster per row than the kernel's. It used to be chosen from
    twice the last count (128 rows), which made every prefill chunk of 128 tokens or more 2.2x slower per token
    (the restore profile: 64 tokens 408 ms, 128 tokens 1,786 ms)."""
    measured = [(2, 20894, 30478), (4, 24225, 56934), (6, 40908, 86430), (8, 45433, 114988), (12, 65715, 172237),
                (16, 89246, 227387), (24, 130139, 327417), (32, 169332, 438787), (48, 257244, 658132),
                (64, 331444, 861819)]
    timings = [RowTiming(*timing) for timing in measured]
    rows = crossover(timings)
    assert rows > 1_000_000  # no product has that many rows: the kernel always
    # The admin API says never as null, not as the sentinel row count (2**62 read as a number of rows).
    from api.schemas import GemmRowsChosen
    from statekeeper.dense_rows_choice import DenseRowsChoice

    choice = DenseRowsChoice(rows, "measured", "AMD EPYC", timings)
    assert GemmRowsChosen.model_validate(choice.report()).rows is None and "never" in choice.note()


def test_a_gemm_that_gains_per_row_is_used_from_where_the_lines_through_the_last_counts_cross():
    timings = [RowTiming(rows, 10.0 * rows, 500.0 + 5.0 * rows) for rows in (16, 32, 48, 64)]
    assert crossover(timings) == 100  # 10 r = 500 + 5 r, past the counts measured: both lines are straight


@pytest.mark.parametrize("gemm_wins_from", [8, 32])
def test_the_measured_crossover_goes_to_every_weight_only_layer(smollm2, tmp_path, gemm_wins_from):
    path = timings_path(tmp_path, smollm2)
    path.write_text(json.dumps({"cpu": machine_id(), "timings": _timings(gemm_wins_from)}))
    choice = choose(smollm2, tmp_path)
    assert choice.rows == gemm_wins_from and _thresholds(smollm2) == {gemm_wins_from}
    assert "measured" in choice.reason and len(choice.timings) == len(ROW_COUNTS)


def test_a_measurement_from_another_machine_is_taken_again(smollm2, tmp_path):
    path = timings_path(tmp_path, smollm2)
    path.write_text(json.dumps({"cpu": "Some Other CPU", "timings": _timings(1000)}))
    choice = choose(smollm2, tmp_path)
    saved = json.loads(path.read_text())
    assert saved["cpu"] == machine_id() == choice.cpu
    assert [t["rows"] for t in saved["timings"]] == list(ROW_COUNTS)
    assert all(t["kernel_us"] > 0 and t["gemm_us"] > 0 for t in saved["timings"])
    assert choice.rows == crossover(choice.timings) and _thresholds(smollm2) == {choice.rows}


def test_a_model_without_weight_only_layers_has_nothing_to_choose(tiny_worker, tmp_path):
    assert choose(tiny_worker, tmp_path) is None and not list(tmp_path.iterdir())


def test_rows_from_the_threshold_go_to_the_gemm():
    generator = torch.Generator().manual_seed(0)
    layer = Int4WeightLinear(torch.randn(48, 128, generator=generator) * 0.05, 32)
    assert layer.dense_from_rows == DENSE_FROM_ROWS
    use_dense_from_rows([layer], 4)
    x = torch.randn(4, 128, generator=generator)
    assert torch.equal(layer(x), layer.dense(x)) and torch.equal(layer(x[:3]), layer.few_rows(x[:3]))


def test_an_explicit_gemm_rows_is_honoured_and_not_measured(tmp_path):
    config = WorkerConfig(model="smollm2", model_cache_dir=MODEL_CACHE, gemm_rows=5)
    worker = ModelWorker(load_model(config.model, config.model_cache_dir), config)
    assert _thresholds(worker) == {5}
    choice = choose(worker, tmp_path)
    assert (choice.rows, choice.reason) == (5, "set by GEMM_ROWS") and not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="gemm_rows"):
        WorkerConfig(gemm_rows=0)
