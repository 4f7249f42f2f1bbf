"""The numeric tests hold whichever kernels torch's libraries pick on the CPU they run on.

MKL, oneDNN and ATen each choose their kernels by the CPU's instruction sets, so a matrix product rounds
differently on an AVX2 machine, on an AMD EPYC (MKL takes its AVX2 paths there; oneDNN has AVX-512 with
bfloat16 but no AMX) and on a Xeon with AMX. Each library can be told to go no further than an instruction
set, so this machine can also run the kernels of the others: the tests whose tolerances depend on
rounding run again in a child process under each limit. On a CPU without an instruction set a limit
naming it changes nothing."""

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

KERNELS = {
    # MKL's AVX2 sgemm (as on AMD), oneDNN's AVX-512 with bfloat16 and no AMX: a Zen 4 EPYC.
    "zen4": {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    # Every library at AVX2: a CPU without AVX-512.
    "avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
}
ROUNDING_TESTS = ["tests/kernels", "tests/statekeeper/compression", "tests/statekeeper/test_batch_forward.py",
                  "tests/statekeeper/test_kv_cache.py", "tests/statekeeper/test_restore_pipeline.py",
                  "tests/statekeeper/test_worker.py"]


@pytest.mark.parametrize("kernels", sorted(KERNELS))
def test_rounding_dependent_tests_pass_with_other_kernels(kernels):
    env = {**os.environ, **KERNELS[kernels]}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ROUNDING_TESTS],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
