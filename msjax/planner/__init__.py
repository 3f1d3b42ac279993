"""Planning tools: which meshes can run a config, their memory, traffic and predicted step time
(no devices needed), and the compiled steps that check them (`python -m msjax.plan`, `msjax.sweep`).
"""
