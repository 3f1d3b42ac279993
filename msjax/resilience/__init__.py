"""Resilience on the worker side: heartbeats, injected faults, skipped steps, compilation caches
and exit codes, used by msjax.train. The supervisor that reads them lives in msjax.launch.
"""
