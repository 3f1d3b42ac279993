"""A run's preparation and what its loop uses: decisions, checkpoints, reporting (layer 7)."""
