"""The engine op battery bench: bench/ops/job.py (runs), bench/ops/analyse.py (judged with the gate's code)."""
