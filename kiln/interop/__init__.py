"""Interoperation with other tools' formats: Hugging Face checkpoints in and out (kiln.interop.hf)."""
