"""Which GEMM the weight-only layers use, and from how many rows, is measured on this machine
(statekeeper/dense_rows_choice.py) and applied to every such layer."""

import json

import pytest
import torch

from kernels.weight_linear import DENSE_FROM_ROWS, Int4WeightLinear, WeightOnlyLinear, use_dense_from_rows
from statekeeper.config import WorkerConfig
from statekeeper.dense_rows_choice import ROW_COUNTS, RowTiming, choose, crossover, faster_gemm, timings_path
from statekeeper.machine import load_timings, machine_id
from statekeeper.model_loader import load_model
from statekeeper.worker import ModelWorker
from tests.conftest import MODEL_CACHE


@pytest.fixture(scope="module")
def smollm2():
    """A SmolLM2 worker of this module's own: the choice changes its layers."""
    config = WorkerConfig(model="smollm2", model_cache_dir=MODEL_CACHE)
    return ModelWorker(load_model(config.model, config.model_cache_dir), config)


def _timings(gemm_wins_from: int, winner: str) -> list[dict]:
    """The `winner` GEMM as fast as the kernel at `gemm_wins_from` rows and faster beyond; the other slower."""
    fast, slow = 10.0 * gemm_wins_from, 20.0 * gemm_wins_from
    return [{"rows": rows, "kernel_us": 10.0 * rows, "bf16_gemm_us": fast if winner == "bfloat16" else slow,
             "fp32_gemm_us": fast if winner == "float32" else slow} for rows in ROW_COUNTS]


def _thresholds(worker) -> set[int]:
    return {m.dense_from_rows for m in worker.model.modules() if hasattr(m, "dense_from_rows")}


def _gemms(worker) -> set[str]:
    return {m.dense.dtype for m in worker.model.modules() if isinstance(m, WeightOnlyLinear)}


def test_the_crossover_is_where_the_gemm_stays_at_least_as_fast():
    timings = [RowTiming(rows, kernel, gemm, 2 * gemm) for rows, kernel, gemm in
               [(4, 1.0, 3.0), (8, 2.0, 1.9), (16, 4.0, 4.5), (32, 8.0, 5.0), (64, 16.0, 6.0)]]
    assert crossover(timings, "bfloat16") == 32  # faster at 8, slower again at 16 (its padding), faster from 32 on
    assert crossover(timings[:1], "bfloat16") == 8  # never faster within the counts measured: past the last one
    assert faster_gemm(timings) == "bfloat16"


def test_an_avx2_cpu_takes_the_float32_gemm_where_bfloat16_is_emulated():
    """This machine's measurement, 2026-11-27: an AMD EPYC with AVX2 and no AVX-512 (torch's CPU capability
    AVX2), the bundled model's 210 weight-only layers, 1 thread; µs per pass. The bfloat16 GEMM is 2.6x slower
    than the kernel at every count and never chosen (issue 31); the float32 GEMM, over the same dequantized
    weights, is as fast as the kernel from 16 rows and 0.64x its time at 64, where prefill chunks were on the
    kernel (BENCHMARKS.md, issue 30)."""
    measured = [(2, 20271, 30554, 53688), (4, 24455, 57582, 49415), (6, 41035, 85153, 59035),
                (8, 44639, 111957, 60905), (12, 65252, 168233, 72442), (16, 85506, 223479, 81586),
                (24, 125831, 328400, 101938), (32, 166349, 435921, 122567), (48, 251104, 656528, 166136),
                (64, 331082, 856445, 212958)]
    timings = [RowTiming(*timing) for timing in measured]
    assert faster_gemm(timings) == "float32" and crossover(timings, "float32") == 16
    assert crossover(timings, "bfloat16") > 1_000_000


def test_a_gemm_that_is_slower_at_every_count_and_falls_further_behind_is_never_used():
    """An AMD EPYC without AVX-512 BF16 (this machine's timings, 2026-11-26): the bfloat16 GEMM is emulated and
    2.6x slower at every count, and its time grows faster per row than the kernel's. It used to be chosen from
    twice the last count (128 rows), which made every prefill chunk of 128 tokens or more 2.2x slower per token
    (the restore profile: 64 tokens 408 ms, 128 tokens 1,786 ms)."""
    measured = [(2, 20894, 30478), (4, 24225, 56934), (6, 40908, 86430), (8, 45433, 114988), (12, 65715, 172237),
                (16, 89246, 227387), (24, 130139, 327417), (32, 169332, 438787), (48, 257244, 658132),
                (64, 331444, 861819)]
    timings = [RowTiming(*timing, fp32_gemm_us=2 * timing[2]) for timing in measured]  # float32 not measured then
    rows = crossover(timings, "bfloat16")
    assert rows > 1_000_000  # no product has that many rows: the kernel always
    # The admin API says never as null, not as the sentinel row count (2**62 read as a number of rows).
    from api.schemas import GemmRowsChosen
    from statekeeper.dense_rows_choice import DenseRowsChoice

    choice = DenseRowsChoice(rows, "measured", "AMD EPYC", timings)
    assert GemmRowsChosen.model_validate(choice.report()).rows is None and "never" in choice.note()


def test_a_gemm_that_gains_per_row_is_used_from_where_the_lines_through_the_last_counts_cross():
    timings = [RowTiming(rows, 10.0 * rows, 500.0 + 5.0 * rows, 600.0 + 5.0 * rows) for rows in (16, 32, 48, 64)]
    assert crossover(timings, "bfloat16") == 100  # 10 r = 500 + 5 r, past the counts measured: straight lines
    assert crossover(timings, "float32") == 120


@pytest.mark.parametrize("gemm_wins_from, winner", [(8, "float32"), (32, "bfloat16"), (32, "float32")])
def test_the_measured_crossover_and_gemm_go_to_every_weight_only_layer(smollm2, tmp_path, gemm_wins_from, winner):
    path = timings_path(tmp_path, smollm2)
    path.write_text(json.dumps({"cpu": machine_id(), "timings": _timings(gemm_wins_from, winner)}))
    choice = choose(smollm2, tmp_path)
    assert choice.rows == gemm_wins_from and _thresholds(smollm2) == {gemm_wins_from}
    assert choice.gemm == winner and _gemms(smollm2) == {winner} and choice.note().startswith(f"{winner} GEMM from")
    assert "measured" in choice.reason and len(choice.timings) == len(ROW_COUNTS)


@pytest.mark.parametrize("kept", ["from another machine", "of repeated row counts"])
def test_a_measurement_from_another_machine_is_taken_again(smollm2, tmp_path, kept):
    """Also one of this machine whose row counts are not the ones measured (two entries of one count made
    the crossover divide by zero at start)."""
    path = timings_path(tmp_path, smollm2)
    timings = _timings(1000, "bfloat16")
    if kept == "from another machine":
        path.write_text(json.dumps({"cpu": "Some Other CPU", "timings": timings}))
    else:
        path.write_text(json.dumps({"cpu": machine_id(), "timings": [t | {"rows": 64} for t in timings]}))
    choice = choose(smollm2, tmp_path)
    saved = json.loads(path.read_text())
    assert saved["cpu"] == machine_id() == choice.cpu
    assert [t["rows"] for t in saved["timings"]] == list(ROW_COUNTS)
    assert all(t["kernel_us"] > 0 and t["bf16_gemm_us"] > 0 and t["fp32_gemm_us"] > 0 for t in saved["timings"])
    gemm = faster_gemm(choice.timings)
    assert (choice.gemm, choice.rows) == (gemm, crossover(choice.timings, gemm))
    assert _gemms(smollm2) == {gemm} and _thresholds(smollm2) == {choice.rows}


def test_timings_kept_before_the_float32_gemm_was_timed_are_measured_again(smollm2, tmp_path):
    """A measurement file of the code before (the kernel and the bfloat16 GEMM only) is not read as a choice."""
    path = timings_path(tmp_path, smollm2)
    old = [{"rows": rows, "kernel_us": 10.0 * rows, "gemm_us": 10.0} for rows in ROW_COUNTS]
    path.write_text(json.dumps({"cpu": machine_id(), "timings": old}))
    assert load_timings(path, RowTiming) is None  # what `choose` reads: None measures afresh


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
