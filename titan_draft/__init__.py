"""Online EAGLE-3 draft co-training for speculative decoding in RL post-training, on torchtitan."""
from titan_draft.infra import _compat  # noqa: F401  (first: torchtitan's CPU workarounds, before any module imports it)
