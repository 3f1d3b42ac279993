"""Flax NNX model code: math and logical axis names only, never meshes."""
