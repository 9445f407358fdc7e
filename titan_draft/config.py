"""titan_draft's sections of torchtitan's TOML JobConfig, and the checks run before any process group.

torchtitan merges this module's `JobConfig` into its own when a TOML file (or the CLI) sets
`[job] custom_config_module = "titan_draft.config"`. Every key of ours lives in [task], [draft],
[rl] or [rollout]; torchtitan's own sections ([model], [training], [parallelism], ...) keep their
meaning.
"""
import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Literal

from titan_draft.infra.errors import ConfigError  # noqa: F401  (re-exported: callers catch config.ConfigError)


@dataclass
class Task:
    name: Literal["sort", "jsonl", "arith"] = "sort"
    """sort: sort letters (synthetic, the laptop default); jsonl: prompts and reference answers from
    training.dataset_path, tokenised by model.hf_assets_path's tokenizer; arith: step-by-step repeated
    addition whose answer lengths are heavy-tailed (titan_draft/data/tasks/)."""
    num_items: int = 10
    """sort: letters per problem."""
    alphabet_size: int = 16
    """sort: distinct letters the problems draw from."""
    sft_swap_prob: float = 0.25
    """The SFT data's systematic error, which RL must undo. sort: probability that an adjacent answer
    pair is swapped; arith: probability that a carry is dropped; jsonl: not used (real data)."""
    prompt_field: str = "prompt"
    """jsonl: the field of each line's JSON object that holds the prompt."""
    answer_field: str = "answer"
    """jsonl: the field that holds the reference answer (final answer after '####', in \\boxed{}, or alone)."""
    chat_template: bool = False
    """jsonl: render each prompt as one user message through the tokenizer's chat template."""
    answer_len_min: int = 30
    """arith: shortest answer, in tokens (answers are whole scratchpad lines, so lengths are approximate)."""
    answer_len_median: int = 60
    """arith: median answer length in tokens; lengths follow a Pareto law truncated to [min, max]."""
    answer_len_max: int = 600
    """arith: longest answer in tokens; training.seq_len must hold the prompt and this."""


@dataclass
class Draft:
    mode: Literal["cotrain", "frozen", "none"] = "cotrain"
    """cotrain: update the draft inside every RL step; frozen: keep the warm-start draft; none: no speculation."""
    tap_layers: list[int] = field(default_factory=list)
    """Policy layers whose outputs feed the draft; empty = (1, L//2-1, L-4) as in EAGLE-3."""
    ttt_steps: int = 3
    """Training-time-test passes D."""
    vocab_size: int = 0
    """Draft vocabulary: the most frequent target tokens; 0 = the policy's whole vocabulary."""
    n_heads: int = 0
    """Draft attention heads; 0 = the policy's."""
    n_kv_heads: int = 0
    """Draft key/value heads; 0 = the policy's."""
    loss_weight: float = 1.0
    """Weight of the draft loss in the co-training step (it has its own optimizer and parameters)."""
    pass_decay: float = 0.8
    """Pass d is weighted pass_decay**(d-1)."""
    lr: float = 1e-3
    """Draft learning rate (AdamW) for warm-up, and for co-training unless cotrain_lr is set."""
    cotrain_lr: float = 0.0
    """Draft learning rate during RL co-training; 0 = draft.lr. A converged draft fine-tuned online at the
    warm-up's rate can lose acceptance to a few noisy updates (docs/RESULTS.md "Co-training's cost")."""
    max_norm: float = 1.0
    """Gradient-norm clip of the draft's parameter group."""
    warmup_steps: int = 200
    """Offline draft training steps on the SFT policy's taps before RL."""
    train_fraction: float = 1.0
    """Fraction of each RL step's rollouts (whole documents, drawn at random) the draft runs on, its loss
    reweighted to an unbiased estimate of the loss over all of them; < 1 cuts the draft's share of the
    train time (docs/RESULTS.md "Co-training's cost")."""
    cp_mode: Literal["ring", "allgather"] = "ring"
    """Context-parallel attention (policy and draft) when parallelism.context_parallel_degree > 1."""
    restore_after_skips: int = 3
    """After this many skipped (non-finite) draft updates in a row, restore the draft and its optimizer
    to their state before the last update; 0 = never."""
    init_path: str = ""
    """A published EAGLE-3 draft folder (SGLang / vLLM layout, as export_draft writes) to start the draft from."""


@dataclass
class RL:
    sft_steps: int = 300
    """Supervised warm start of the policy on the task."""
    sft_lr: float = 3e-3
    sft_batch_size: int = 32
    prompts_per_step: int = 32
    """Prompts per RL step; each is sampled group_size times."""
    group_size: int = 8
    lr: float = 3e-4
    """Policy learning rate during RL."""
    clip_eps: float = 0.2
    """PPO/GRPO clip range of the importance ratio."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference (start-of-RL) policy; 0 disables it."""
    stop_after_skips: int = 3
    """Stop the job (exit 3) after this many RL steps in a row whose policy update was skipped because its
    loss or gradient norm was not finite; 0 = never stop."""
    kl_to_start_metric: bool = False
    """Report kl_to_start (mean log p - log p_ref over response tokens) when kl_coef = 0 too. The reference
    (start-of-RL) policy is only built when kl_coef > 0 or this is set: it costs a copy of the weights (in
    the compute dtype) and one more forward per step."""
    logprob_chunk_size: int = 0
    """Rows per chunk of the LM head in SFT, the GRPO loss and the draft's teacher: log-probs, entropy and
    teacher logits come from the final hidden states chunk by chunk, and backward recomputes each chunk's
    logits, so no [rows, vocabulary] tensor is kept; 0 = all rows in one (full logits)."""
    max_tokens_per_microbatch: int = 0
    """Packed rows (tokens) per forward and backward of the RL update, SFT and the draft warm-up: batches are
    split into micro-batches of whole documents, gradients accumulate and the losses keep the whole batch's
    normalisation; 0 = the whole batch in one. Must hold one document: >= training.seq_len."""


@dataclass
class Rollout:
    num_speculative_tokens: int = 4
    """Draft tokens K proposed per verify forward."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 0
    """Response budget per rollout; 0 = the task's own (task.max_new_tokens)."""
    adaptive: bool = True
    """Pick the number of draft tokens (0..num_speculative_tokens) before every decode step for the most
    tokens per second, from measured step costs and acceptance (rollout/goodput.py GoodputController);
    false = always num_speculative_tokens. Measured costs make adaptive runs not bit-reproducible."""
    compile: bool = True
    """torch.compile the engine's policy blocks, draft forwards and the acceptance rule on GPUs (fused
    norms, RoPE, cache writes and acceptance arithmetic: fewer kernels per decode step; the rule reads
    the logits once; ignored on CPU). Each new step shape compiles once, in the first steps' rollouts."""
    few_row_linear: bool = True
    """On GPUs, the policy's block projections in decode and verify steps of at most 16 rows x positions
    run a Triton kernel that streams each weight once (ops/skinny_linear.py; its block sizes are the
    H200's fastest, bench/skinny_linear.py); false: cuBLAS at every size."""
    release_caches: bool = True
    """Give the engine's KV caches (and the CUDA graphs that read them) back after each step's rollouts, so
    the training phase has their memory; false keeps them and their graphs (no re-capture each step)."""
    dump_samples: int = 0
    """Rollouts per RL step written to <dump_folder>/rollouts/step_<k>.jsonl for people to read."""


@dataclass
class ActivationCheckpoint:
    """Merged into torchtitan's [activation_checkpoint] section: only the default differs."""

    mode: Literal["selective", "full", "memory_budget", "none"] = "none"
    """Activation checkpointing of the policy's layers, applied as torchtitan applies it
    (parallelize.apply_activation_checkpointing); none by default: the small presets fit without it."""


@dataclass
class LRScheduler:
    """Merged into torchtitan's [lr_scheduler] section, which schedules the SFT warm start's learning rate
    (rl.sft_lr over rl.sft_steps; RL runs at a constant rl.lr): titan_draft's defaults are 20 warm-up
    steps, then constant. A decay (decay_ratio, decay_type, min_lr_factor) ends SFT at a low rate."""

    warmup_steps: int = 20
    decay_ratio: float | None = 0.0


@dataclass
class JobConfig:
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    task: Task = field(default_factory=Task)
    draft: Draft = field(default_factory=Draft)
    rl: RL = field(default_factory=RL)
    rollout: Rollout = field(default_factory=Rollout)


def parse_config(args: list[str]):
    """torchtitan's parser (TOML < CLI) with this module's sections always merged in."""
    from torchtitan.config import ConfigManager

    if not any(a.startswith(("--job.custom_config_module", "--job.custom-config-module")) for a in args):
        args = [*args, "--job.custom_config_module", __name__]
    return ConfigManager().parse_args(args)


def validate(cfg, world_size: int):
    """Raise ConfigError (one line: key, value, allowed range, fix) for settings that cannot work; else
    return the run's plan (titan_draft.plan.RunPlan: the config resolved for `world_size` processes).

    Runs before any process group exists, so a bad config never half-starts a job.
    """
    from titan_draft.formats.hf import check_hf_assets
    from titan_draft.models import policy_args, tap_layers
    from titan_draft.plan import build_plan

    check_hf_assets(cfg, needs_tokenizer=cfg.task.name == "jsonl")  # first: the model's shape may come from there
    args = policy_args(cfg)
    n_layers, vocab_size = args.n_layers, args.vocab_size

    def need(ok: bool, msg: str):
        if not ok:
            raise ConfigError(msg)

    _check_types(cfg, "", need)  # first: the checks below compare numbers
    d, rl, ro, p = cfg.draft, cfg.rl, cfg.rollout, cfg.parallelism
    layers = tap_layers(cfg.draft, n_layers)
    for layer in layers:
        need(0 <= layer < n_layers, f"draft.tap_layers: layer {layer} is out of range 0..{n_layers - 1} "
             f"for a {n_layers}-layer policy; pick layers in 0..{n_layers - 1}")
    need(len(set(layers)) == len(layers) and layers == sorted(layers),
         f"draft.tap_layers: {layers} must be distinct and ascending; e.g. {sorted(set(layers))}")
    need(d.ttt_steps >= 1, f"draft.ttt_steps: {d.ttt_steps} must be >= 1")
    need(0 <= d.vocab_size <= vocab_size, f"draft.vocab_size: {d.vocab_size} is larger than the policy's "
         f"vocabulary ({vocab_size}); use 1..{vocab_size} (0 = all)")
    need(d.pass_decay > 0, f"draft.pass_decay: {d.pass_decay} must be > 0")
    need(d.lr > 0 and d.loss_weight >= 0, "draft.lr must be > 0 and draft.loss_weight >= 0")
    need(d.cotrain_lr >= 0, f"draft.cotrain_lr: {d.cotrain_lr} must be >= 0 (0 = draft.lr)")
    need(0 < d.train_fraction <= 1,
         f"draft.train_fraction: {d.train_fraction} must be in (0, 1] (1 = every rollout)")
    need(rl.group_size >= 2, f"rl.group_size: {rl.group_size} must be >= 2 (GRPO compares samples of one prompt)")
    need(rl.prompts_per_step >= 1, f"rl.prompts_per_step: {rl.prompts_per_step} must be >= 1")
    need(ro.num_speculative_tokens >= 1, f"rollout.num_speculative_tokens: {ro.num_speculative_tokens} must be >= 1")
    need(ro.temperature >= 0, f"rollout.temperature: {ro.temperature} must be >= 0 (0 = greedy)")
    need(0 < ro.top_p <= 1, f"rollout.top_p: {ro.top_p} must be in (0, 1]")
    need(ro.max_new_tokens >= 0, f"rollout.max_new_tokens: {ro.max_new_tokens} must be >= 0 (0 = the task's "
         "answer length + 2)")
    need(rl.lr > 0, f"rl.lr: {rl.lr} must be > 0 (the policy's learning rate in RL)")
    need(rl.sft_lr > 0, f"rl.sft_lr: {rl.sft_lr} must be > 0 (the policy's learning rate in SFT)")
    need(rl.sft_batch_size >= 1, f"rl.sft_batch_size: {rl.sft_batch_size} must be >= 1")
    need(rl.clip_eps > 0, f"rl.clip_eps: {rl.clip_eps} must be > 0 (the ratio is clipped to 1 - clip_eps .. "
         "1 + clip_eps)")
    need(rl.logprob_chunk_size >= 0, f"rl.logprob_chunk_size: {rl.logprob_chunk_size} must be >= 0 (rows per "
         "chunk of the LM head; 0 = no chunking)")
    need(rl.max_tokens_per_microbatch == 0 or rl.max_tokens_per_microbatch >= cfg.training.seq_len,
         f"rl.max_tokens_per_microbatch: {rl.max_tokens_per_microbatch} is below training.seq_len = "
         f"{cfg.training.seq_len}, which one rollout can fill; use 0 (no micro-batches) or >= {cfg.training.seq_len}")
    t = cfg.task
    need(0 <= t.sft_swap_prob <= 1, f"task.sft_swap_prob: {t.sft_swap_prob} must be a probability in [0, 1]")

    degrees = {
        "parallelism.data_parallel_replicate_degree": p.data_parallel_replicate_degree,
        "parallelism.tensor_parallel_degree": p.tensor_parallel_degree,
        "parallelism.context_parallel_degree": p.context_parallel_degree,
        "parallelism.pipeline_parallel_degree": p.pipeline_parallel_degree,
    }
    product = 1
    for key, value in degrees.items():
        need(value >= 1, f"{key}: {value} must be >= 1")
        product *= value
    shard = p.data_parallel_shard_degree
    need(world_size % product == 0, f"parallelism: replicate x tp x cp x pp = {product} does not divide "
         f"the world size {world_size}; {_degree_fix(degrees, world_size)}")
    need(shard == -1 or shard * product == world_size,
         f"parallelism.data_parallel_shard_degree: {shard} x (replicate x tp x cp x pp = {product}) "
         f"= {shard * product} != world size {world_size}; set it to {world_size // product} or -1")
    plan = build_plan(cfg, world_size)  # what it resolves (draft mode, tap layers, degrees) is checked above
    cp = p.context_parallel_degree
    seq = cfg.training.seq_len
    need(seq >= 1, f"training.seq_len: {seq} must be >= 1")
    from titan_draft.data.tasks import check_task

    check_task(cfg, vocab_size, plan)  # the task's own lengths, data and tokenizer
    need(cfg.training.seq_len % (2 * cp) == 0, f"training.seq_len: {cfg.training.seq_len} is not divisible by "
         f"2 * context_parallel_degree = {2 * cp}; use a multiple of {2 * cp}")
    _validate_compile(cfg, need)
    pp = p.pipeline_parallel_degree
    need(pp <= n_layers, f"parallelism.pipeline_parallel_degree: {pp} exceeds the policy's {n_layers} layers")
    _validate_composition(cfg, plan, args, need)
    return plan


def _degree_fix(degrees: dict, world_size: int) -> str:
    """A change that makes the degrees' product divide the world size: the largest degree brought down to
    a divisor of itself (which still divides what it divided), else a multiple of the product as the world size."""
    key = max(degrees, key=degrees.get)
    others = 1
    for name, value in degrees.items():
        others *= value if name != key else 1
    if world_size % others == 0:
        fit = math.gcd(degrees[key], world_size // others)
        return f"set {key} to {fit}, or run a multiple of {others * degrees[key]} processes (NGPU)"
    return f"run a multiple of {others * degrees[key]} processes (NGPU)"


def _check_types(section, prefix: str, need) -> None:
    """Every value has its field's type: torchtitan passes TOML values on unchecked (tyro only warns)."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        value, key = getattr(section, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            _check_types(value, key + ".", need)
        else:
            need(_has_type(value, hints[f.name]), f"{key}: {value!r} has type {type(value).__name__}, expected "
                 f"{_type_name(hints[f.name])}; fix it in the config file")


def _has_type(value, hint) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_has_type(value, a) for a in args)
    if origin is Literal:
        return value in args
    if origin is list:
        return isinstance(value, list) and all(_has_type(v, args[0]) for v in value)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return not isinstance(hint, type) or isinstance(value, hint)


def _type_name(hint) -> str:
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    return getattr(hint, "__name__", str(hint)) if isinstance(hint, type) else str(hint)


def _validate_compile(cfg, need) -> None:
    """torchtitan's [compile] and what needs it (titan_draft/parallel/parallelize.py compiles)."""
    from titan_draft.parallel.parallelize import compiles

    c, ac = cfg.compile, cfg.activation_checkpoint.mode
    unknown = sorted(set(c.components) - {"model", "loss"})
    need(not unknown, f"compile.components: {unknown} unknown; use 'model' and/or 'loss'")
    need(ac != "memory_budget" or compiles(cfg, "model"), f"activation_checkpoint.mode: '{ac}' needs the model "
         "compiled; set compile.enable = true (with 'model' in compile.components) or use 'none', 'selective' "
         "or 'full'")
    need(not (c.enable and cfg.parallelism.context_parallel_degree > 1), "compile.enable: context parallelism's ring "
         "attention is not compiled; set compile.enable = false or parallelism.context_parallel_degree = 1")
    need(not (c.enable and cfg.parallelism.tensor_parallel_degree > 1), "compile.enable: tensor-parallel blocks "
         "(replicated norms, no sequence parallelism) fail in a compiled backward; set compile.enable = false or "
         "parallelism.tensor_parallel_degree = 1")


def _validate_composition(cfg, plan, args, need) -> None:
    """Parallel layouts, data split, checkpointing and timeouts (titan_draft/parallel/parallelize.py,
    titan_draft/checkpoint.py)."""
    p, ck, comm = cfg.parallelism, cfg.checkpoint, cfg.comm
    need(p.expert_parallel_degree == 1, f"parallelism.expert_parallel_degree: {p.expert_parallel_degree} is not "
         "supported (dense policies only); set it to 1")
    dp = plan.dp
    need(cfg.rl.prompts_per_step % dp == 0, f"rl.prompts_per_step: {cfg.rl.prompts_per_step} does not divide "
         f"among the {dp} data-parallel ranks; use a multiple of {dp}")
    if plan.pp > 1:
        _validate_pipeline(cfg, dp, args.n_layers, need)
    tp = plan.tp
    if tp > 1:
        need(cfg.rl.logprob_chunk_size == 0, f"rl.logprob_chunk_size: {cfg.rl.logprob_chunk_size} needs the whole LM "
             "head on every rank, but tensor parallelism splits it over the vocabulary; set it to 0")
        need(cfg.model.name == "llama3", f"model.name: tensor parallelism is wired for llama3 only, not "
             f"'{cfg.model.name}'; set parallelism.tensor_parallel_degree = 1")
        heads = {"policy heads (model.flavor)": args.n_heads, "policy kv heads (model.flavor)": args.n_kv_heads or
                 args.n_heads, "draft.n_heads": cfg.draft.n_heads or args.n_heads,
                 "draft.n_kv_heads": cfg.draft.n_kv_heads or cfg.draft.n_heads or args.n_kv_heads or args.n_heads}
        heads["draft.vocab_size (the draft's lm_head is split over it)"] = cfg.draft.vocab_size or args.vocab_size
        for key, count in heads.items():
            need(count % tp == 0, f"parallelism.tensor_parallel_degree: {tp} does not divide the {count} {key}; "
                 f"use a degree that divides it")
    need(ck.async_mode == "disabled", f"checkpoint.async_mode: '{ck.async_mode}' is not supported; use 'disabled'")
    need(not ck.last_save_in_hf, "checkpoint.last_save_in_hf: not supported (a full checkpoint keeps the draft); "
         "export with titan_draft.formats.hf.save_policy and `python -m titan_draft.cli.export_draft`")
    need(ck.keep_latest_k == 0 or ck.keep_latest_k >= 2, f"checkpoint.keep_latest_k: {ck.keep_latest_k} must be 0 "
         "(keep all) or >= 2 (the newest may be mid-save)")
    need(ck.interval >= 1, f"checkpoint.interval: {ck.interval} must be >= 1 (RL steps between checkpoints)")
    need(comm.init_timeout_seconds > 0 and comm.train_timeout_seconds > 0,
         f"comm.init_timeout_seconds / train_timeout_seconds: {comm.init_timeout_seconds} / "
         f"{comm.train_timeout_seconds} must be > 0 seconds")


def _validate_pipeline(cfg, dp: int, layers: int, need) -> None:
    """The RL step through pipeline stages (titan_draft/rl/pipelined_policy.py)."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    from titan_draft.parallel.pipeline import pipeline_num_stages

    p = cfg.parallelism
    pp, schedule, microbatch = p.pipeline_parallel_degree, p.pipeline_parallel_schedule, \
        p.pipeline_parallel_microbatch_size
    try:
        get_schedule_class(schedule)
    except ValueError:
        need(False, f"parallelism.pipeline_parallel_schedule: '{schedule}' is unknown; use 1F1B, GPipe or "
             "Interleaved1F1B")
    need(schedule not in ("InterleavedZeroBubble", "ZBVZeroBubble"), f"parallelism.pipeline_parallel_schedule: "
         f"'{schedule}' cannot run the RL step (torch's zero-bubble runtime fails on the reference policy's "
         "forward-only pass and on FSDP-wrapped stages' weight pass); use 1F1B, GPipe or Interleaved1F1B")
    stages = pipeline_num_stages(pp, schedule)
    need(stages <= layers, f"parallelism.pipeline_parallel_schedule: '{schedule}' on {pp} pipeline ranks needs "
         f"{stages} stages, more than the policy's {layers} layers; use 1F1B or GPipe, or a smaller degree")
    rows = cfg.rl.prompts_per_step * cfg.rl.group_size // dp
    need(microbatch >= 1 and rows % microbatch == 0, f"parallelism.pipeline_parallel_microbatch_size: {microbatch} "
         f"does not divide the {rows} rollouts of a data-parallel rank (rl.prompts_per_step x rl.group_size / "
         f"{dp}); use a divisor of {rows}")
    max_tokens, one_per_stage = cfg.rl.max_tokens_per_microbatch, pp * microbatch * cfg.training.seq_len
    need(max_tokens == 0 or max_tokens >= one_per_stage, f"rl.max_tokens_per_microbatch: {max_tokens} holds less than "
         f"one pipeline microbatch of full rows per pipeline rank (parallelism.pipeline_parallel_degree {pp} x "
         f"pipeline_parallel_microbatch_size {microbatch} x training.seq_len {cfg.training.seq_len}); use 0 or "
         f">= {one_per_stage}")
