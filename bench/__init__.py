"""Benchmarks (not tests): ``scripts/bench`` runs ``python -m bench``."""
