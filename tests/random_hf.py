"""Tiny random Hugging Face models for the import and export tests (nothing downloaded)."""

from __future__ import annotations

from pathlib import Path


def save_random(model: object, directory: Path, seed: int) -> None:
    """The model's weights drawn far from transformers' default init (norms around 1, the rest
    N(0, 0.2)), so a wrong layout shows; saved in directory."""
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(1 + 0.2 * torch.randn_like(parameter))
            else:
                parameter.normal_(0, 0.2)
    model.save_pretrained(directory)
