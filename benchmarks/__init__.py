"""The benchmarks, each run from the repository root as a module: `python -m benchmarks.<name>`. What they
share is benchmarks.harness."""
