"""Orbax checkpoints of msjax runs: async saving, verified restore onto any mesh, inspection.

`python -m msjax.checkpoint list RUN_DIR` and `python -m msjax.checkpoint inspect PATH`.
"""
