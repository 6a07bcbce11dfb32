"""The parts of ``benchmarks/gpu_acceptance.py``: one module per GPU claim (see that script)."""
