"""Command-line tools beside training: validate.py (check a config), export_draft.py (the draft for SGLang/vLLM)."""
