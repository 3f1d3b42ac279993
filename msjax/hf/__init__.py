"""Hugging Face interop: `python -m msjax.hf export` writes a run's checkpoint as a Llama model."""
