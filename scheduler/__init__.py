"""Restore planning and execution (Krul §6): which layers and tokens to load vs recompute.
Today a restore loads everything that a valid blob holds and recomputes the rest of the history."""
