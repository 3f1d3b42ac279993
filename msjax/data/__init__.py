"""Training data: the byte tokenizer, the embedded stdlib corpus and the Grain batch pipeline."""
