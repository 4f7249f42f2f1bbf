"""Placement over a day of conversations without a model (issue 32): a trace of turns (trace.py) drives the
service's own tier manager and eviction policy over tiers that keep only sizes (simulator.py)."""
