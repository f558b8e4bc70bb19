"""Calibration and analysis of captured statistics (numpy, polars, scipy). Fits land here."""
