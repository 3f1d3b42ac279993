"""Resilience: heartbeats, the watchdog supervisor, restart policy, fault injection, goodput.

Worker side (imported by msjax.train): heartbeat, faults, skips, worker. Supervisor side
(`python -m msjax.launch`, never imports JAX): supervisor, incidents, goodput.
"""
