"""The evaluation harness: what compression costs the next replies (`statekeeper eval`), offline
calibration (`statekeeper calibrate`) and the workloads they read (ShareGPT, needles, recall).

Never imported by the server: the service reads only the per-head profile that calibration writes
(statekeeper/compression/head_profile.py). Nothing is imported here, so `evaluation.needles` and
`evaluation.datasets` stay loadable without torch (benchmarks/kvpress_peer.py runs in another venv)."""
