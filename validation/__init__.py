"""Validation: sweeps against float64 oracles, error growth, planted defects, reports."""
