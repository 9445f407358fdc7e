"""Hugging Face interchange: the policy round-trips through HF safetensors with identical logits, its
tokenizer comes along; the exported EAGLE-3 draft, read by a loader written here from the engines' layout
(SGLang / vLLM llama_eagle3: names, shapes, half-split RoPE), gives the draft's logits; each engine's
tap-layer id rule (re-implemented here from its code) feeds the draft exactly the trained taps; the
draft loads back through titan_draft.formats.eagle3.load_draft (--draft.init_path) bit for bit, and refuses a
draft it cannot take or a checkpoint saved before the draft warm-up, in one line per problem."""
import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from titan_draft.checkpoint import IN_RL, SFT_DONE, WARMUP_DONE, TrainState
from titan_draft.cli.export_draft import main as export_draft_main
from titan_draft.config import ConfigError, parse_config
from titan_draft.data.packing import pack
from titan_draft.formats.eagle3 import IDS_KEY, engine_default_taps, export_draft, load_draft, tap_layer_ids
from titan_draft.formats.hf import load_policy, save_policy
from titan_draft.models import build_draft, default_tap_layers
from titan_draft.models.draft import EagleDraft, draft_args_for
from titan_draft.models.policy import TapRecorder, build_policy, forward_packed, model_args

ROOT = os.path.join(os.path.dirname(__file__), "..")
CONFIG = os.path.join(ROOT, "train_configs", "sort_tiny_cpu.toml")
JOB = ["--job.config_file", CONFIG, "--model.flavor", "tiny_gqa", "--training.seq_len", "32",
       "--draft.tap_layers", "0", "1", "2", "--draft.vocab_size", "12", "--debug.seed", "4"]


def packed_documents(vocab: int):
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, vocab, (n,), generator=g) for n in (9, 14, 5)]
    return pack(docs, [torch.ones(len(d), dtype=torch.bool) for d in docs])


def write_tokenizer(folder, vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size - 1)} | {"<unk>": vocab_size - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))


def test_policy_round_trip_identical_logits_and_tokenizer(tmp_path):
    args = model_args("llama3", "tiny_gqa", 32)
    policy = build_policy("llama3", "tiny_gqa", 32, seed=1)
    write_tokenizer(tmp_path / "tok", args.vocab_size)
    save_policy(policy, "llama3", args, str(tmp_path / "hf"), tokenizer_dir=str(tmp_path / "tok"))

    saved = load_file(tmp_path / "hf" / "model.safetensors")
    assert saved["model.embed_tokens.weight"].shape == (args.vocab_size, args.dim)
    assert saved["model.layers.0.self_attn.k_proj.weight"].shape == (args.n_kv_heads * args.dim // args.n_heads,
                                                                     args.dim)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_hidden_layers"] == args.n_layers and config["num_key_value_heads"] == args.n_kv_heads
    assert not any(name.endswith(".tmp") or ".tmp-" in name for name in os.listdir(tmp_path))

    other = build_policy("llama3", "tiny_gqa", 32, seed=2)
    batch = packed_documents(args.vocab_size)
    with torch.no_grad():
        want = forward_packed(policy, batch)
        assert not torch.equal(forward_packed(other, batch), want)
        tokenizer = load_policy(other, "llama3", args, str(tmp_path / "hf"))
        assert torch.equal(forward_packed(other, batch), want)
    assert tokenizer.encode("t3 t5", add_bos=False, add_eos=False) == [3, 5]


def rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def engine_layout_logits(folder, taps, next_embeddings, positions):
    """Pass 1 of an EAGLE-3 draft of one document, from the files alone, as the engines compute it:
    fc(taps); concat(input_layernorm(embed), hidden_norm(hidden)) -> causal attention with
    half-split (rotate_half) RoPE and GQA; residual; MLP; norm; lm_head; then d2t to target ids."""
    cfg = json.loads(open(os.path.join(folder, "config.json")).read())
    w = load_file(os.path.join(folder, "model.safetensors"))
    H, nh, nkv, hd, eps = (cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                            "head_dim", "rms_norm_eps"))
    assert w["fc.weight"].shape == (H, 3 * cfg["target_hidden_size"])
    assert w["midlayer.self_attn.q_proj.weight"].shape == (nh * hd, 2 * H)
    assert w["lm_head.weight"].shape == (cfg["draft_vocab_size"], H)
    assert w["d2t"].dtype == torch.int64 and w["t2d"].shape == (cfg["vocab_size"],)
    T = len(positions)
    hidden = taps @ w["fc.weight"].T
    x = torch.cat([rms(next_embeddings, w["midlayer.input_layernorm.weight"], eps),
                   rms(hidden, w["midlayer.hidden_norm.weight"], eps)], dim=-1)
    q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(T, nh, hd)
    k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(T, nkv, hd)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(T, nkv, hd)
    inv_freq = 1.0 / cfg["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd)
    angles = torch.cat([positions[:, None].float() * inv_freq] * 2, dim=-1)[:, None]
    rotate_half = lambda t: torch.cat([-t[..., hd // 2:], t[..., : hd // 2]], dim=-1)  # noqa: E731
    q, k = (t * angles.cos() + rotate_half(t) * angles.sin() for t in (q, k))
    k, v = (t.repeat_interleave(nh // nkv, dim=1) for t in (k, v))
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    h = hidden + out.transpose(0, 1).reshape(T, nh * hd) @ w["midlayer.self_attn.o_proj.weight"].T
    y = rms(h, w["midlayer.post_attention_layernorm.weight"], eps)
    mlp = (F.silu(y @ w["midlayer.mlp.gate_proj.weight"].T) * (y @ w["midlayer.mlp.up_proj.weight"].T))
    h = h + mlp @ w["midlayer.mlp.down_proj.weight"].T
    logits = rms(h, w["norm.weight"], eps) @ w["lm_head.weight"].T
    target_ids = torch.arange(cfg["draft_vocab_size"]) + w["d2t"]
    return logits, target_ids, w["embed_tokens.weight"]


def trained_like_draft(cfg):
    args = model_args(cfg.model.name, cfg.model.flavor, cfg.training.seq_len)
    torch.manual_seed(7)
    draft = EagleDraft(draft_args_for(args, 3, cfg.draft.vocab_size))
    draft.init_weights()
    with torch.no_grad():
        for norm in (draft.norm, draft.midlayer.input_layernorm, draft.midlayer.hidden_norm):
            norm.weight.uniform_(0.5, 1.5)  # not all ones, so a swapped norm would show
    draft.set_vocab(torch.randperm(args.vocab_size)[: cfg.draft.vocab_size].sort().values)
    return args, draft


def test_exported_draft_matches_engine_layout_and_reloads(tmp_path):
    cfg = parse_config(JOB)
    args, draft = trained_like_draft(cfg)
    embed = torch.randn(args.vocab_size, args.dim)
    export_draft(draft, [0, 1, 2], str(tmp_path / "draft"), n_layers=args.n_layers, engine="sglang",
                 embed_tokens=embed)
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"] == {"use_aux_hidden_state": True, IDS_KEY: [0, 1, 2]} and IDS_KEY not in config
    assert (config["vocab_size"], config["draft_vocab_size"]) == (args.vocab_size, cfg.draft.vocab_size)

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab_size, (11,), generator=g)
    batch = pack([tokens], [torch.ones(11, dtype=torch.bool)])
    taps = torch.randn(11, 3 * args.dim, generator=g)
    shift, attn = batch.shift(3), batch.draft_attention
    with torch.no_grad():
        states = draft.ttt_forward(embed[tokens], taps, batch.positions, 1, shift, attn)
        want = draft.logits(states[0])
    next_embeddings = torch.cat([embed[tokens[1:]], torch.zeros(1, args.dim)])  # row i reads x_{i+1}
    got, target_ids, saved_embed = engine_layout_logits(str(tmp_path / "draft"), taps, next_embeddings,
                                                        batch.positions)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(target_ids, draft.target_ids()) and torch.equal(saved_embed, embed)


# --- each engine's tap-layer id rule, re-implemented from its code -------------------------------------
def vllm_capture(config: dict, n_layers: int) -> list[int]:
    """Layers before which vLLM captures the residual stream (hidden_states + residual) for the draft.
    vllm-project/vllm vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py @ da84445 and
    vllm/v1/worker/gpu_model_runner.py @ 4e17906: the draft config's top-level ids, used as they are;
    none -> vllm/model_executor/models/llama.py @ e06c9ba get_eagle3_aux_hidden_state_layers."""
    ids = config.get(IDS_KEY)
    return list(ids) if ids else [2, n_layers // 2, n_layers - 3]


def vllm_capture_with_eagle_config_fallback(config: dict, n_layers: int) -> list[int]:
    """The vLLM model runners that look in eagle_config when the top level has no ids."""
    return vllm_capture(config, n_layers) if config.get(IDS_KEY) else \
        vllm_capture({IDS_KEY: config.get("eagle_config", {}).get(IDS_KEY)}, n_layers)


def sglang_capture(config: dict, n_layers: int) -> list[int]:
    """sgl-project/sglang python/sglang/srt/model_executor/model_runner.py: ids = eagle_config[IDS_KEY]
    (None if absent); python/sglang/srt/models/llama.py @ bf7a0e2 set_eagle3_layers_to_capture:
    None -> [2, L//2, L-3], else [val + 1 for val in ids] (qwen3.py the same)."""
    ids = (config.get("eagle_config") or {}).get(IDS_KEY)
    return [2, n_layers // 2, n_layers - 3] if ids is None else [val + 1 for val in ids]


def layer_inputs(policy, batch, recorders: list[TapRecorder]) -> list[torch.Tensor]:
    """One forward: the state entering each decoder layer ([T, H], layer order); `recorders` record too."""
    entering = {}
    hooks = [layer.register_forward_pre_hook(lambda _m, inputs, i=int(i): entering.__setitem__(i, inputs[0]))
             for i, layer in policy.layers.items()]
    with contextlib.ExitStack() as stack, torch.no_grad():
        for recorder in recorders:
            stack.enter_context(recorder)
        forward_packed(policy, batch)
    for hook in hooks:
        hook.remove()
    return [entering[i].flatten(0, 1) for i in range(len(policy.layers))]


def engine_aux_hidden_states(entering: list[torch.Tensor], capture: list[int]) -> torch.Tensor:
    """What both engines' LlamaModel.forward hand the draft: for i in range(L), if i in capture, the
    state entering layer i (hidden_states + residual), in layer order, each layer once; concatenated
    as fc reads them."""
    return torch.cat([entering[i] for i in range(len(entering)) if i in capture], dim=-1)


ENGINE_RULES = {"vllm": [vllm_capture, vllm_capture_with_eagle_config_fallback], "sglang": [sglang_capture]}
ENGINE_RULES["both"] = ENGINE_RULES["vllm"] + ENGINE_RULES["sglang"]


@pytest.mark.parametrize("model_name", ["llama3", "qwen3"])
def test_each_engine_feeds_the_draft_exactly_the_trained_taps(model_name):
    policy = build_policy(model_name, "small", 16, seed=0, device="cpu")
    n_layers = len(policy.layers)
    default = default_tap_layers(n_layers)
    assert engine_default_taps(n_layers) == default == [1, 3, 4]
    recorders = [TapRecorder(policy, default), TapRecorder(policy, [0, 2, n_layers - 2])]
    entering = layer_inputs(policy, packed_documents(32), recorders)
    no_ids = {"eagle_config": {"use_aux_hidden_state": True}}  # a published draft without ids: the default taps
    for rule in ENGINE_RULES["both"]:
        assert torch.equal(engine_aux_hidden_states(entering, rule(no_ids, n_layers)), recorders[0].taps())
    for recorder in recorders:
        taps, trained = recorder.layer_ids, recorder.taps()
        for engine, rules in ENGINE_RULES.items():
            config = tap_layer_ids(taps, n_layers, engine)
            for rule in rules:
                assert torch.equal(engine_aux_hidden_states(entering, rule(config, n_layers)), trained), \
                    (engine, rule.__name__, taps)
        # the conventions really differ: SGLang's ids read by a vLLM that looks in eagle_config
        sglang_ids = tap_layer_ids(taps, n_layers, "sglang")
        assert not torch.equal(engine_aux_hidden_states(
            entering, vllm_capture_with_eagle_config_fallback(sglang_ids, n_layers)), trained)


def test_export_refuses_taps_an_engine_cannot_feed():
    for engine in ENGINE_RULES:
        with pytest.raises(ConfigError) as error:
            tap_layer_ids([0, 1, 3], 4, engine)  # 3 is the last layer's output
        assert str(error.value) == ("draft.tap_layers: [0, 1, 3] cannot be fed by SGLang or vLLM to a 4-layer policy: "
                                    "they capture the state entering a decoder layer, so only distinct ascending "
                                    "outputs of layers 0..2 (not the last layer's); train with such taps to export")
    with pytest.raises(ConfigError, match="exactly 3 tap layers, this draft has 2"):
        tap_layer_ids([1, 2], 8, "sglang")


# --- load_draft (--draft.init_path) -----------------------------------------------------------------
@pytest.mark.parametrize("engine,taps,n_layers", [("vllm", [0, 1, 2], 4), ("sglang", [0, 1, 2], 4),
                                                  ("both", [1, 3, 4], 8)])
def test_exported_draft_loads_back_bit_exact(tmp_path, engine, taps, n_layers):
    cfg = parse_config(JOB)
    _, draft = trained_like_draft(cfg)
    export_draft(draft, taps, str(tmp_path / "draft"), n_layers=n_layers, engine=engine,
                 embed_tokens=torch.randn(draft.args.target_vocab_size, draft.args.dim))
    _, other = trained_like_draft(parse_config(JOB + ["--debug.seed", "9"]))
    with torch.no_grad():
        other.fc.weight.zero_()
        other.set_vocab(torch.arange(cfg.draft.vocab_size))
    load_draft(other, str(tmp_path / "draft"), taps, n_layers=n_layers)
    mine, theirs = draft.state_dict(), other.state_dict()
    assert mine.keys() == theirs.keys()
    for name, tensor in mine.items():
        assert torch.equal(theirs[name], tensor), name


def test_load_draft_rebuilds_the_vocabulary_maps_a_draft_omits(tmp_path):
    """Both engines skip t2d, and a draft over the whole vocabulary may carry no d2t either."""
    _, draft = trained_like_draft(parse_config(JOB + ["--draft.vocab_size", "32"]))  # the whole vocabulary
    export_draft(draft, [0, 1, 2], str(tmp_path / "full"), n_layers=4, engine="sglang")
    _, partial = trained_like_draft(parse_config(JOB))
    partial.set_vocab(torch.arange(2, 2 + partial.args.draft_vocab_size))  # a draft vocabulary that is not a prefix
    export_draft(partial, [0, 1, 2], str(tmp_path / "partial"), n_layers=4, engine="sglang")
    for folder, dropped, source in (("full", ("d2t", "t2d"), draft), ("partial", ("t2d",), partial)):
        file = tmp_path / folder / "model.safetensors"
        save_file({k: v for k, v in load_file(file).items() if k not in dropped}, file)
        loaded = EagleDraft(source.args)
        load_draft(loaded, str(tmp_path / folder), [0, 1, 2], n_layers=4)
        assert torch.equal(loaded.d2t, source.d2t) and torch.equal(loaded.t2d, source.t2d), folder


def test_load_draft_names_every_mismatch_in_one_line(tmp_path):
    cfg = parse_config(JOB)
    _, draft = trained_like_draft(cfg)
    folder = str(tmp_path / "draft")
    export_draft(draft, [0, 1, 2], folder, n_layers=4, engine="vllm")
    args = model_args(cfg.model.name, cfg.model.flavor, cfg.training.seq_len)

    narrow = EagleDraft(draft_args_for(args, 3, 10, n_heads=2))
    with pytest.raises(ConfigError) as error:
        load_draft(narrow, folder, [0, 1, 2], n_layers=4)
    assert str(error.value) == (
        f"{folder}: num_attention_heads is 4, this job's draft has 2; set --draft.n_heads 4\n"
        f"{folder}: draft_vocab_size is 12, this job's draft has 10; set --draft.vocab_size 12")

    with pytest.raises(ConfigError) as error:
        load_draft(EagleDraft(draft.args), folder, [0, 1, 3], n_layers=4)
    assert str(error.value) == (
        f"{folder}: {IDS_KEY} [1, 2, 3] (vLLM numbering): the draft was trained on the outputs of layers "
        f"[0, 1, 2], this job taps [0, 1, 3]; set --draft.tap_layers 0 1 2")

    config = json.loads(open(os.path.join(folder, "config.json")).read())
    config["eagle_config"][IDS_KEY] = [0, 1, 3]  # SGLang numbering, other layers than the top-level ids
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ConfigError) as error:
        load_draft(EagleDraft(draft.args), folder, [0, 1, 2], n_layers=4)
    assert str(error.value) == (
        f"{folder}: {IDS_KEY} [1, 2, 3] (vLLM numbering) and eagle_config.{IDS_KEY} [0, 1, 3] (SGLang numbering) "
        f"name different layers ([0, 1, 2] vs [0, 1, 3]); keep the one of the engine the draft was trained for")

    with pytest.raises(ConfigError) as error:
        load_draft(draft, str(tmp_path), [0, 1, 2], n_layers=4)
    assert str(error.value) == (f"{tmp_path / 'config.json'}: not found; point --draft.init_path at an EAGLE-3 "
                                f"draft folder (config.json + *.safetensors)")


# --- python -m titan_draft.cli.export_draft ---------------------------------------------------------------
def save_job_checkpoint(folder, draft, embed, phase: int) -> None:
    """The parts of a job checkpoint the exporter reads (titan_draft/checkpoint.py names)."""
    train_state = TrainState()
    train_state.phase = phase
    dcp.save({"draft": draft.state_dict(), "tok_embeddings.weight": embed, "train_state": train_state},
             checkpoint_id=str(folder))


def test_export_draft_command_reads_the_latest_complete_checkpoint(tmp_path):
    cfg = parse_config(JOB)
    args, draft = trained_like_draft(cfg)
    embed = torch.randn(args.vocab_size, args.dim)
    folder = tmp_path / "checkpoint"
    save_job_checkpoint(folder / "step-3", draft, embed, IN_RL)
    (folder / "step-7").mkdir()  # an interrupted save: no .metadata
    export_draft_main(["--checkpoint", str(folder), "--output", str(tmp_path / "out"), "--engine", "vllm", *JOB])
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert torch.equal(saved["lm_head.weight"], draft.lm_head.weight)
    assert torch.equal(saved["embed_tokens.weight"], embed) and torch.equal(saved["d2t"], draft.d2t)
    assert json.loads((tmp_path / "out" / "config.json").read_text())[IDS_KEY] == [1, 2, 3]
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        export_draft_main(["--checkpoint", str(tmp_path / "out"), "--output", str(tmp_path / "x"), *JOB])


def test_export_draft_command_refuses_a_checkpoint_before_the_draft_warmup(tmp_path):
    cfg = parse_config(JOB)
    args, draft = trained_like_draft(cfg)
    step = tmp_path / "checkpoint" / "step-1"
    save_job_checkpoint(step, draft, torch.randn(args.vocab_size, args.dim), SFT_DONE)
    command = [sys.executable, "-m", "titan_draft.cli.export_draft", "--checkpoint", str(step), "--output",
               str(tmp_path / "out"), "--engine", "vllm", *JOB]
    refused = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 1 and refused.stderr == (
        f"export_draft: --checkpoint {step}: holds phase SFT_DONE (the policy after SFT, draft not warmed up), its "
        f"draft is untrained; export a checkpoint from after the draft warm-up (step-{WARMUP_DONE} or later), or "
        f"resume the job until the warm-up ends\n")  # one line, no traceback
    assert not (tmp_path / "out").exists()


RUN = ["--job.config_file", CONFIG, "--training.seq_len", "16", "--task.num_items", "2", "--task.alphabet_size", "4",
       "--rl.sft_steps", "4", "--draft.warmup_steps", "2", "--rl.prompts_per_step", "4", "--rl.group_size", "2",
       "--rl.sft_batch_size", "8", "--training.steps", "1", "--checkpoint.enable", "--checkpoint.interval", "1",
       "--metrics.no-enable-tensorboard"]  # the default job (its model and taps), shortened


def test_default_job_checkpoint_exports_for_every_engine_and_refuses_its_sft_step(tmp_path):
    """A short default job (SFT -> step-1, warm-up -> step-2, one RL step -> step-3), then the exporter
    for each engine: the folder loads back bit for bit and each engine's rule feeds it the trained taps."""
    job = subprocess.run([sys.executable, "-m", "titan_draft.train", *RUN, "--job.dump_folder", str(tmp_path / "job")],
                         cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=300)
    assert job.returncode == 0, job.stderr[-3000:]
    checkpoints = tmp_path / "job" / "checkpoint"
    with pytest.raises(ConfigError, match=f"^--checkpoint {checkpoints / 'step-1'}: holds phase SFT_DONE"):
        export_draft_main(["--checkpoint", str(checkpoints / "step-1"), "--output", str(tmp_path / "out"), *RUN])

    cfg = parse_config(RUN)
    args = model_args(cfg.model.name, cfg.model.flavor, cfg.training.seq_len)
    trained, layers = build_draft(cfg, args, torch.device("cpu"))
    assert layers == [0, 1, 2]  # train_configs/sort_tiny_cpu.toml's
    dcp.load({"draft": trained.state_dict()}, checkpoint_id=str(checkpoints / "step-3"))
    for engine, rules in ENGINE_RULES.items():
        out = tmp_path / engine
        export_draft_main(["--checkpoint", str(checkpoints), "--output", str(out), "--engine", engine, *RUN])
        config = json.loads((out / "config.json").read_text())
        for rule in rules:  # the layers it enters: the outputs of layers 0, 1, 2
            assert rule(config, args.n_layers) == [1, 2, 3], (engine, rule.__name__)
        loaded, _ = build_draft(parse_config(RUN + ["--debug.seed", "5"]), args, torch.device("cpu"))
        load_draft(loaded, str(out), layers, n_layers=args.n_layers)
        for name, tensor in trained.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], tensor), (engine, name)
