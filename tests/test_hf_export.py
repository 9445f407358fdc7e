"""Hugging Face interchange: the policy round-trips through HF safetensors with identical logits, its
tokenizer comes along, and the exported EAGLE-3 draft, read by a loader written here from the
engines' layout (SGLang / vLLM llama_eagle3: names, shapes, half-split RoPE), gives the draft's logits."""
import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from safetensors.torch import load_file

from titan_draft import _compat  # noqa: F401
from titan_draft.config import parse_config
from titan_draft.cotrain import local_draft_inputs
from titan_draft.export_draft import export_draft, main as export_draft_main
from titan_draft.hf import load_draft, load_policy, save_policy
from titan_draft.models.draft import EagleDraft, draft_args_for
from titan_draft.models.policy import build_policy, forward_packed, model_args
from titan_draft.packing import pack

CONFIG = os.path.join(os.path.dirname(__file__), "..", "train_configs", "sort_tiny_cpu.toml")
JOB = ["--job.config_file", CONFIG, "--model.flavor", "tiny_gqa", "--training.seq_len", "32",
       "--draft.tap_layers", "0", "1", "3", "--draft.vocab_size", "12", "--debug.seed", "4"]


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
    export_draft(draft, [0, 1, 3], str(tmp_path / "draft"), embed_tokens=embed)
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 3]
    assert (config["vocab_size"], config["draft_vocab_size"]) == (args.vocab_size, cfg.draft.vocab_size)

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab_size, (11,), generator=g)
    batch = pack([tokens], [torch.ones(11, dtype=torch.bool)])
    taps = torch.randn(11, 3 * args.dim, generator=g)
    shift, attn = local_draft_inputs(batch)
    with torch.no_grad():
        states = draft.ttt_forward(embed[tokens], taps, batch.positions, 1, shift, attn)
        want = draft.logits(states[0])
    next_embeddings = torch.cat([embed[tokens[1:]], torch.zeros(1, args.dim)])  # row i reads x_{i+1}
    got, target_ids, saved_embed = engine_layout_logits(str(tmp_path / "draft"), taps, next_embeddings,
                                                        batch.positions)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(target_ids, draft.target_ids()) and torch.equal(saved_embed, embed)

    _, other = trained_like_draft(parse_config(JOB + ["--debug.seed", "9"]))
    with torch.no_grad():
        other.fc.weight.zero_()
    load_draft(other, str(tmp_path / "draft"))
    for name, tensor in draft.state_dict().items():
        assert torch.equal(other.state_dict()[name], tensor), name


def test_export_draft_command_reads_the_latest_complete_checkpoint(tmp_path):
    cfg = parse_config(JOB)
    args, draft = trained_like_draft(cfg)
    embed = torch.randn(args.vocab_size, args.dim)
    folder = tmp_path / "checkpoint"
    dcp.save({"draft": draft.state_dict(), "tok_embeddings.weight": embed}, checkpoint_id=str(folder / "step-3"))
    (folder / "step-7").mkdir()  # an interrupted save: no .metadata
    export_draft_main(["--checkpoint", str(folder), "--output", str(tmp_path / "out"), *JOB])
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert torch.equal(saved["lm_head.weight"], draft.lm_head.weight)
    assert torch.equal(saved["embed_tokens.weight"], embed) and torch.equal(saved["d2t"], draft.d2t)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        export_draft_main(["--checkpoint", str(tmp_path / "out"), "--output", str(tmp_path / "x"), *JOB])
