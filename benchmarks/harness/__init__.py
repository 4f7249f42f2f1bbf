"""What every benchmark shares, and the tests too: one percentile definition; the machine line printed with
each figure (machine) and, in each --json file, the record of that machine and commit (results: write_json,
machine_record); Markdown tables (tables); the model options and the worker of the scripts that time one in
their own process (model); the servers they start on loopback (redis_server, postgres_server, nginx_server;
the service in-process (live_server, openai_server) or as a replica process of its own (replica_server)); and
a tiny model built on the spot (tiny_model).

The scripts run from the repository root as modules, `python -m benchmarks.<name>`: Python then looks for
imports in the directory it starts in before anywhere else, so a script in a worktree of another commit
imports that checkout's statekeeper and harness, not the checkout the virtual environment's editable install
points at. No script edits the import path, and one that starts another script starts it the same way
(`-m`, in the repository root)."""

from benchmarks.harness.machine import cpu_model, machine_line
from benchmarks.harness.model import MODEL_CACHE, add_model_arguments, load_worker
from benchmarks.harness.percentiles import percentile
from benchmarks.harness.results import machine_record, write_json
from benchmarks.harness.tables import StreamedTable, markdown_table

__all__ = ["MODEL_CACHE", "add_model_arguments", "cpu_model", "load_worker", "machine_line", "machine_record",
           "StreamedTable", "markdown_table", "percentile", "write_json"]
