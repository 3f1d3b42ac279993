"""Shared pytest setup: 8 simulated CPU devices, set before anything imports jax."""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
