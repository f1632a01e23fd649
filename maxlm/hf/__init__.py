"""Interop with Hugging Face `transformers`: `mapping.py` (the Llama <-> maxlm weight and config
mapping) and `files.py` (reading a HF folder to initialise from, writing one on export)."""
