"""The job's two models: the policy (policy.py) and its EAGLE-3 draft (draft.py), built from the job config."""
from titan_draft.config import tap_layers
from titan_draft.models.draft import EagleDraft, draft_args_for
from titan_draft.models.policy import build_policy, model_args


def build_draft(cfg, policy_args, device) -> tuple[EagleDraft, list[int]]:
    """The draft for this policy and the config's tap layers, initialised from the global RNG; and those layers."""
    layers = tap_layers(cfg, policy_args.n_layers)
    d = cfg.draft
    draft = EagleDraft(draft_args_for(policy_args, len(layers), d.vocab_size, d.n_heads, d.n_kv_heads)).to(device)
    draft.init_weights()
    return draft, layers


def build_models(cfg, device):
    """Policy and draft, initialised from the config's seed."""
    max_len = cfg.training.seq_len
    args = model_args(cfg.model.name, cfg.model.flavor, max_len)
    policy = build_policy(cfg.model.name, cfg.model.flavor, max_len, seed=cfg.debug.seed)
    draft, layers = build_draft(cfg, args, device)
    return args, policy, draft, layers
