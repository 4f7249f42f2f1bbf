"""What every benchmark shares, and the tests too: one percentile definition, the machine line printed with
each figure, and the servers they start on loopback (redis_server, postgres_server, nginx_server; the service
in-process (live_server, openai_server) or as a replica process of its own (replica_server)), and a tiny
model built on the spot (tiny_model)."""

from benchmarks.harness.machine import cpu_model, machine_line
from benchmarks.harness.percentiles import percentile

__all__ = ["cpu_model", "machine_line", "percentile"]
