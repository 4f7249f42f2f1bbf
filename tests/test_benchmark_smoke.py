"""Benchmarks that run rarely (the GPU one only where a GPU is lent) smoke-tested here on the CPU, so that
their code keeps up with the service's: benchmarks/gpu_restore.py on the tiny model, a few hundred tokens."""

import json


def test_the_gpu_restore_benchmark_runs_its_cpu_smoke_test(tmp_path):
    from benchmarks import gpu_restore

    out = tmp_path / "smoke.json"
    gpu_restore.main(["--device", "cpu", "--lengths", "120,240", "--repeats", "1", "--json", str(out)])
    result = json.loads(out.read_text())
    (shape,) = result["shapes"].values()
    assert [row["tokens"] for row in shape["lengths"]] == [120, 240]
    for row in shape["lengths"]:
        assert {"hot", "restored exact", "restored compressed", "recomputed"} <= set(row["ttft_ms"])
