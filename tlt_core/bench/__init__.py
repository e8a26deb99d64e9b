"""Benchmarks behind `tlt bench ...`: each times tlt_core against a baseline side by side in
one process and reports ratios (machines here are shared and noisy; absolute times are not
comparable across runs)."""
