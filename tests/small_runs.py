"""The overrides of a training run small enough for a unit test (seconds on one CPU core)."""

QUICK_RUN = [
    "model.num_layers=2",
    "model.embed_dim=64",
    "model.mlp_dim=128",
    "data.seq_len=32",
    "data.max_corpus_mib=1",
    "train.global_batch=8",
    "train.peak_tflops=0.5",
]
