"""The module ops bench: bench/modules/faults.py (runs), analyse.py (judged with the gate's code), derive.py (entries)."""
