"""Calibration: honest runs of an image in the gate's sandbox turned into a hardware class's tolerance entry
(`skupin calibrate`; calibrate.py). A caller of the gate, as the A/B is: it refuses poison first (pins, quantized
weights, hard bounds, the float32 pass) and derives thresholds with the gate's own comparison code."""
