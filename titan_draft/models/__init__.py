"""The job's two models: the policy (policy.py) and its EAGLE-3 draft (draft.py), built from the job config."""
from titan_draft.models.draft import EagleDraft, draft_args_for
from titan_draft.models.policy import job_model_args, policy_from_args


def default_tap_layers(n_layers: int) -> list[int]:
    """EAGLE-3's taps: the outputs of layers (1, L//2-1, L-4), distinct and ascending."""
    return sorted({1, n_layers // 2 - 1, n_layers - 4})


def tap_layers(draft_cfg, n_layers: int) -> list[int]:
    """[draft] tap_layers, or the default ones when empty."""
    return list(draft_cfg.tap_layers) or default_tap_layers(n_layers)


def policy_args(cfg):
    """The policy's torchtitan model args from the job config ([model] name / flavor / hf_assets_path,
    training.seq_len)."""
    return job_model_args(cfg)


def build_draft(cfg, args, device) -> tuple[EagleDraft, list[int]]:
    """The draft for a policy of torchtitan `args` and the config's tap layers (initialised from the global
    RNG), and those layers."""
    layers = tap_layers(cfg.draft, args.n_layers)
    d = cfg.draft
    draft = EagleDraft(draft_args_for(args, len(layers), d.vocab_size, d.n_heads, d.n_kv_heads)).to(device)
    draft.init_weights()
    return draft, layers


def build_models(cfg, device):
    """(policy args, policy, draft): both models initialised from the config's seed."""
    args = policy_args(cfg)
    policy = policy_from_args(args, seed=cfg.debug.seed)
    draft, _ = build_draft(cfg, args, device)  # the job's tap layers are its plan's
    return args, policy, draft
