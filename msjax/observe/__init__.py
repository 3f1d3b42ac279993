"""Measuring runs: FLOPs and MFU, metrics and progress, per-rank timing and stragglers, the flight
recorder, and the plots of the run report."""
