"""What a measurement is kept for (statekeeper/machine.py): a CPU named and described by the instruction sets
its kernels dispatch on, so that a timing taken on one machine is never read on another."""

import json

import pytest

from statekeeper.dense_rows_choice import RowTiming
from statekeeper.kv_dtype_choice import DtypeTiming
from statekeeper.machine import describe_cpu, load_timings, machine_id

GRAVITON = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm {extra}
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: {variant}
CPU part\t: {part}
"""
XEON = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse2 avx2 avx512f avx512_vnni avx512_bf16 {extra}
"""


def test_two_arm64_cpus_without_model_names_are_told_apart():
    """arm64's /proc/cpuinfo names no model: both Gravitons were "aarch64", and a Graviton2's timings (no bf16)
    were read on a Graviton3."""
    graviton2 = describe_cpu(GRAVITON.format(extra="", variant="0x3", part="0xd0c"))
    graviton3 = describe_cpu(GRAVITON.format(extra="sve bf16 i8mm", variant="0x1", part="0xd40"))
    assert graviton2 != graviton3
    assert "part 0xd0c" in graviton2[0] and graviton3[1] == ["asimd", "sve", "bf16", "i8mm"]


def test_one_cpu_name_with_and_without_amx_is_two_machines():
    """A VM names its CPU generically; a hypervisor or kernel that hides AMX runs other kernels under that name."""
    with_amx, without = describe_cpu(XEON.format(extra="amx_bf16 amx_tile")), describe_cpu(XEON.format(extra=""))
    assert with_amx[0] == without[0] and with_amx[1] != without[1]


@pytest.mark.parametrize("record, timings", [
    (DtypeTiming, [{"dtype": "float32", "decode_ms": None, "batched_ms": 1.0}]),
    (DtypeTiming, [{"dtype": 32, "decode_ms": 1.0, "batched_ms": 1.0}]),
    (RowTiming, [{"rows": "64", "kernel_us": 1.0, "bf16_gemm_us": 1.0, "fp32_gemm_us": 1.0}]),
    (RowTiming, [{"rows": 64, "kernel_us": float("nan"), "bf16_gemm_us": 1.0, "fp32_gemm_us": 1.0}]),
])
def test_timings_that_parse_but_are_not_numbers_are_measured_again(tmp_path, record, timings):
    """A file that parses as JSON with a null or a string where a time is failed the start later (a TypeError
    in the choice), where an unreadable one is measured again."""
    path = tmp_path / "timings.json"
    path.write_text(json.dumps({"cpu": machine_id(), "timings": timings}))
    assert load_timings(path, record) is None
