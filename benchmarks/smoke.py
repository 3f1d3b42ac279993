"""Tiny sizes for every benchmark's `--smoke` form: the whole script in seconds, so the suite
runs it (tests/jobs/test_benchmarks.py) and a broken benchmark fails CI. Its numbers mean
nothing."""

# a 2-layer model of width 64 in place of the benchmark's own, and a short sequence
TINY_MODEL = [
    "model.num_layers=2",
    "model.embed_dim=64",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.mlp_dim=128",
]
TINY_SEQ_LEN = 32
TINY_CORPUS = ["data.max_corpus_mib=1"]
SMOKE_LABEL = " (smoke: tiny model)"  # in the first line each smoke form prints
