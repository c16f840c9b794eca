"""Numerical-correctness harness for parallel training: configs, warm rank pool, comparison, goldens."""
