"""Measuring runs: FLOPs and MFU, against the model's analytic FLOP count and the device's peak."""
