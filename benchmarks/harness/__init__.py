"""What every benchmark shares: one percentile definition and the machine line printed with each figure."""

from benchmarks.harness.machine import cpu_model, machine_line
from benchmarks.harness.percentiles import percentile

__all__ = ["cpu_model", "machine_line", "percentile"]
