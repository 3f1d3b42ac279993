"""`python -m msjax.launch`: start the workers of one `jax.distributed` job under a supervisor.

distributed.py is the environment contract between the launcher and each worker; the
supervisor itself lives in msjax.resilience.supervisor.
"""
