"""Pallas (Triton backend) and jax-triton GPU kernels, each beside its plain-JAX reference."""
