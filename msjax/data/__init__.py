"""Training data: tokenizers, corpus sources and their cached token stores, packing into
documents, the global sample order of a weighted mixture, and the Grain pipeline to devices."""
