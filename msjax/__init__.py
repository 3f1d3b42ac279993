"""msjax: a JAX/XLA training stack for decoder-only language models on device meshes."""

__version__ = "0.1.0"
