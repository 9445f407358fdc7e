"""Speculative rollouts: the acceptance rule and the KV-cached EAGLE-3 engine."""
from titan_draft.rollout.engine import EngineOptions, RolloutEngine, RolloutResult
from titan_draft.rollout.goodput import GoodputController
from titan_draft.rollout.sampling import (probs_from_logits, sample, sample_from_logits, speculative_accept,
                                         speculative_accept_from_logits)

__all__ = ["EngineOptions", "GoodputController", "RolloutEngine", "RolloutResult", "probs_from_logits", "sample",
           "sample_from_logits", "speculative_accept", "speculative_accept_from_logits"]
