"""`python -m msjax.launch`: the launcher and its supervisor, which start, watch and restart the
workers of one `jax.distributed` job (supervisor, attempt, fault_detection, incidents, workers).
"""
