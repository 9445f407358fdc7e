"""Checkpoint formats other tools read and write: Hugging Face policies (hf.py), EAGLE-3 drafts (eagle3.py)."""
