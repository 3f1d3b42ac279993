"""Parallelism applied from outside the model: meshes, logical-axis rules, shardings."""
