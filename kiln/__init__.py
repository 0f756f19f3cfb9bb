"""kiln: train transformer language models on one GPU or a plain CPU."""
__version__ = "0.1.0"
