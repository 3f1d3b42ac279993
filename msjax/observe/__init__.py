"""Measuring runs: FLOPs and MFU, metrics and progress, per-rank timing and stragglers, the flight
recorder, and for the run report, the run directory read back and its plots."""
