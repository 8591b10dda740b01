"""Standalone tools that run outside skupin's process and import nothing of it (standard library, plus the image's own
torch and engine for the probe): the probe (in images under test and on the reference GPU), the locked-step wheel
installer and the bytecode compiler (bound into builds), and the bytecode verifier (on the gate host)."""
