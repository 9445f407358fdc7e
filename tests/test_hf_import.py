"""Hugging Face policies through the job's path (model.flavor "hf" + checkpoint.initial_load_path):
tiny random checkpoints made here by transformers (a Llama-3.1 style one with llama3 RoPE scaling,
a Qwen3 one with tied embeddings and head_dim != hidden / heads) and a tokenizer trained here give,
loaded by model_args + build_policy + load_policy, transformers' own logits on a packed batch of
prompts of different lengths, and the rollout engine's greedy rollouts equal transformers'
generate(do_sample=False) token for token. Sharded checkpoints load; bad folders get one line."""
import dataclasses
import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from scripts.make_tiny_hf import EOS_ID, arithmetic_problems, problem_texts, write_tiny_checkpoint
from titan_draft.config import ConfigError, parse_config
from titan_draft.data.packing import pack
from titan_draft.formats.hf import check_hf_assets, load_policy, save_policy, state_dict_adapter, tokenizer_vocab_size
from titan_draft.models.families import family_of_args
from titan_draft.models.policy import build_policy, forward_packed, model_args, policy_from_args
from titan_draft.rollout import RolloutEngine

SEQ_LEN = 96
VOCAB = 384
FIX = "use the config.json saved with these weights (model.flavor 'hf') or the matching model.flavor"


@pytest.fixture(scope="module")
def problems():
    return arithmetic_problems(64, seed=0)


@pytest.fixture(scope="module", params=["llama3", "qwen3"])
def checkpoint(request, tmp_path_factory, problems):
    folder = str(tmp_path_factory.mktemp(request.param) / "hf")
    write_tiny_checkpoint(folder, request.param, problem_texts(problems), vocab_size=VOCAB, seed=1)
    return request.param, folder


def job_policy(name: str, folder: str):
    """The policy as the job builds it: shape from config.json, weights from the safetensors."""
    args = model_args(name, "hf", SEQ_LEN, folder)
    policy = build_policy(name, "hf", SEQ_LEN, seed=0, hf_assets_path=folder)
    tokenizer = load_policy(policy, name, args, folder)
    return args, policy, tokenizer


def transformers_model(folder: str):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def encode_prompts(tokenizer, problems) -> list[torch.Tensor]:
    return [torch.tensor(tokenizer.encode(p["prompt"], add_bos=True, add_eos=False)) for p in problems]


@torch.no_grad()
def packed_logits(policy, prompts: list[torch.Tensor]) -> torch.Tensor:
    return forward_packed(policy, pack(prompts, [torch.ones(len(p), dtype=torch.bool) for p in prompts]))


@torch.no_grad()
def test_packed_logits_equal_transformers_forward(checkpoint, problems):
    name, folder = checkpoint
    args, policy, tokenizer = job_policy(name, folder)
    hf = transformers_model(folder)
    prompts = encode_prompts(tokenizer, problems[:5])
    assert len({len(p) for p in prompts}) > 1, "the batch must mix prompt lengths"
    want = torch.cat([hf(p[None]).logits[0] for p in prompts])
    got = packed_logits(policy, prompts)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=5e-5)

    if name == "llama3":  # the llama3 RoPE scaling was read, and it matters at these positions
        assert dataclasses.astuple(args.rope_scaling_args) == (8.0, 1.0, 4.0, 64)
        unscaled = policy_from_args(dataclasses.replace(args, rope_scaling_args=type(args.rope_scaling_args)(1.0)))
        unscaled.load_state_dict(policy.state_dict())
        assert (packed_logits(unscaled, prompts) - want).abs().max() > 1e-2
    else:  # tied in the checkpoint: the untied output starts as a copy of the embedding
        assert args.head_dim == 32 and args.head_dim * args.n_heads != args.dim
        assert torch.equal(policy.output.weight, policy.tok_embeddings.weight)
        assert policy.output.weight.data_ptr() != policy.tok_embeddings.weight.data_ptr()


@torch.no_grad()
def test_exported_policy_gives_transformers_the_same_logits(checkpoint, problems, tmp_path):
    """save_policy of an imported (and then changed) policy: transformers reads the folder and
    computes the policy's logits; the tokenizer files come along."""
    name, folder = checkpoint
    args, policy, tokenizer = job_policy(name, folder)
    for parameter in policy.parameters():  # as after training: no longer the imported weights
        parameter.add_(0.01 * torch.randn_like(parameter))
    save_policy(policy, name, args, str(tmp_path / "out"), tokenizer_dir=folder)
    assert os.path.isfile(tmp_path / "out" / "tokenizer.json")
    prompts = encode_prompts(tokenizer, problems[:3])
    hf = transformers_model(str(tmp_path / "out"))
    want = torch.cat([hf(p[None]).logits[0] for p in prompts])
    torch.testing.assert_close(packed_logits(policy, prompts), want, rtol=1e-5, atol=5e-5)


def greedy_transformers(hf, prompts: list[torch.Tensor], max_new_tokens: int, eos_id: int) -> list[torch.Tensor]:
    """Each prompt alone (no padding): its greedy response, the eos included if emitted."""
    return [hf.generate(p[None], max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_id,
                        pad_token_id=eos_id)[0, len(p):] for p in prompts]


def greedy_engine(engine, prompts: list[torch.Tensor], max_new_tokens: int, eos_id: int) -> list[torch.Tensor]:
    """The engine's greedy responses, all prompts in one batch. Prompts of different lengths go in
    as a list (the engine's variable-length interface), equal ones as one [B, P] tensor."""
    lengths = [len(p) for p in prompts]
    batch = torch.stack(prompts) if len(set(lengths)) == 1 else prompts
    result = engine.generate(batch, max_new_tokens, num_speculative_tokens=0, temperature=0.0, eos_id=eos_id)
    return [result.tokens[b, p:p + int(n)] for b, (p, n) in enumerate(zip(lengths, result.response_lengths))]


def first_new_token(tokens: list[int], start: int) -> int:
    """The first token at index >= start that the sequence has not produced before."""
    return next(t for i, t in enumerate(tokens) if i >= start and t not in tokens[:i])


def assert_greedy_equal(engine, hf, prompts: list[torch.Tensor], max_new_tokens: int) -> None:
    """Engine == transformers with the tokenizer's eos, then with a token that row 0 first emits
    mid-answer as the eos (row 0 stops early with it, the other rows need not)."""
    want = greedy_transformers(hf, prompts, max_new_tokens, EOS_ID)
    assert [g.tolist() for g in greedy_engine(engine, prompts, max_new_tokens, EOS_ID)] == [w.tolist() for w in want]
    stop = first_new_token(want[0].tolist()[:-1], 3)
    want = greedy_transformers(hf, prompts, max_new_tokens, stop)
    assert len(want[0]) < max_new_tokens and want[0][-1] == stop
    assert [g.tolist() for g in greedy_engine(engine, prompts, max_new_tokens, stop)] == [w.tolist() for w in want]


@torch.no_grad()
def test_engine_greedy_rollouts_equal_transformers_generate(checkpoint, problems):
    """Prompts of one length in one batch, and prompts of different lengths in one batch (each row
    its own positions, its own eos; no padding seen): token for token what transformers generates."""
    name, folder = checkpoint
    args, policy, tokenizer = job_policy(name, folder)
    hf = transformers_model(folder)
    encoded = encode_prompts(tokenizer, problems)
    lengths = [len(p) for p in encoded]
    same_length = [p for p in encoded if len(p) == max(lengths, key=lengths.count)][:3]
    assert len(same_length) == 3
    mixed = sorted({len(p): p for p in encoded}.values(), key=len)[:4]  # four different lengths
    assert len({len(p) for p in mixed}) == 4
    max_new = 20
    engine = RolloutEngine(args, None, [0], 4, max(lengths) + max_new, "cpu", torch.float32)
    engine.load_weights(policy)
    assert_greedy_equal(engine, hf, same_length, max_new)
    assert_greedy_equal(engine, hf, mixed, max_new)


def test_sharded_checkpoint_loads_like_the_single_file(tmp_path, problems):
    write_tiny_checkpoint(str(tmp_path / "one"), "llama3", problem_texts(problems), vocab_size=VOCAB, seed=3)
    write_tiny_checkpoint(str(tmp_path / "shards"), "llama3", problem_texts(problems), vocab_size=VOCAB, seed=3,
                          max_shard_size="60KB")
    index = json.loads((tmp_path / "shards" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    _, one, _ = job_policy("llama3", str(tmp_path / "one"))
    _, sharded, _ = job_policy("llama3", str(tmp_path / "shards"))
    for key, tensor in one.state_dict().items():
        assert torch.equal(sharded.state_dict()[key], tensor), key

    os.remove(tmp_path / "shards" / shards[1])
    with pytest.raises(ConfigError) as error:
        job_policy("llama3", str(tmp_path / "shards"))
    assert str(error.value) == (f"checkpoint.initial_load_path: {tmp_path / 'shards' / shards[1]} is listed in "
                                "model.safetensors.index.json but missing; copy every shard of the checkpoint "
                                "into the folder")


def test_weights_that_do_not_fit_name_the_tensor_and_file(tmp_path, problems):
    folder = tmp_path / "hf"
    write_tiny_checkpoint(str(folder), "llama3", problem_texts(problems), vocab_size=VOCAB, seed=3)
    weights = folder / "model.safetensors"
    args = model_args("llama3", "hf", SEQ_LEN, str(folder))
    state = load_file(weights)

    save_file({k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}, weights)
    with pytest.raises(ConfigError) as error:
        load_policy(policy_from_args(args), "llama3", args, str(folder))
    assert str(error.value) == ("checkpoint.initial_load_path: no tensor 'model.layers.1.mlp.up_proj.weight' (the "
                                f"policy's 'layers.1.feed_forward.w3.weight') in the safetensors files of {folder}; "
                                + FIX)

    save_file({**state, "model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}, weights)
    with pytest.raises(ConfigError) as error:
        load_policy(policy_from_args(args), "llama3", args, str(folder))
    assert str(error.value) == (f"checkpoint.initial_load_path: {weights}: 'model.layers.0.self_attn.q_proj.bias' "
                                f"(64,) has no place in the policy; {FIX}")

    save_file(state, weights)
    wider = dataclasses.replace(args, multiple_of=192, ffn_dim_multiplier=None)
    with pytest.raises(ConfigError) as error:
        load_policy(policy_from_args(wider), "llama3", wider, str(folder))
    assert str(error.value) == (f"checkpoint.initial_load_path: {weights}: 'model.layers.0.mlp.down_proj.weight' is "
                                f"(64, 160) but the policy's 'layers.0.feed_forward.w2.weight' is (64, 192); {FIX}")


def write_config(folder, **changes) -> str:
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder / "config.json")


def test_hub_style_config_reads_like_transformers_5_style(checkpoint, tmp_path):
    """Hub files keep `rope_theta` at the top and the scaling in `rope_scaling`; transformers 5
    writes both into `rope_parameters`."""
    name, folder = checkpoint
    want = model_args(name, "hf", SEQ_LEN, folder)
    hub = tmp_path / "hub"
    hub.mkdir()
    (hub / "config.json").write_text((open(os.path.join(folder, "config.json")).read()))
    rope = json.loads((hub / "config.json").read_text())["rope_parameters"]
    theta = rope.pop("rope_theta")
    write_config(hub, rope_parameters=None, rope_theta=theta, rope_scaling=rope if name == "llama3" else None)
    assert model_args(name, "hf", SEQ_LEN, str(hub)) == want
    assert want.rope_theta == theta and want.vocab_size == VOCAB and want.n_kv_heads == 2


# The hub's config.json of three real models (the keys that matter), for shape checks on "meta".
HUB_CONFIGS = {
    "Llama-3.1-8B": ("llama3", dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=False, hidden_act="silu",
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192))),
    "Llama-3.2-1B": ("llama3", dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
        rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192))),
    "Qwen3-1.7B": ("qwen3", dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        rms_norm_eps=1e-6, rope_theta=1000000, rope_scaling=None, max_position_embeddings=40960,
        tie_word_embeddings=True, use_sliding_window=False, sliding_window=None, attention_bias=False)),
}


@pytest.mark.parametrize("hub_model", sorted(HUB_CONFIGS))
def test_hub_configs_give_the_hub_models_weight_shapes(hub_model, tmp_path):
    """Every weight of the real model, by name and shape (torchtitan's FFN width rule included), on
    the "meta" device: the policy built from config.json, in HF names, equals transformers' model."""
    name, config = HUB_CONFIGS[hub_model]
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = model_args(name, "hf", 4096, str(tmp_path))
    policy = build_policy(name, "hf", 4096, device="meta", hf_assets_path=str(tmp_path))
    ours = {k: tuple(v.shape) for k, v in state_dict_adapter(name, args).to_hf(policy.state_dict()).items()}
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(str(tmp_path)))
    assert ours == {k: tuple(v.shape) for k, v in hf.state_dict().items()}


def job_config(folder, *extra: str):
    return parse_config(["--model.flavor", "hf", "--model.hf_assets_path", str(folder), *extra])


def test_check_hf_assets_error_lines(checkpoint, tmp_path):
    name, folder = checkpoint
    arch = {"llama3": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[name]
    model = ["--model.name", name]
    check_hf_assets(job_config(folder, *model, "--checkpoint.initial_load_path", folder,
                               "--checkpoint.initial_load_in_hf"), needs_tokenizer=True)

    def error(cfg) -> str:
        with pytest.raises(ConfigError) as e:
            check_hf_assets(cfg, needs_tokenizer=True)
        return str(e.value)

    empty = tmp_path / "empty"
    empty.mkdir()
    assert error(job_config(empty, *model)) == (f"model.hf_assets_path: {empty}/config.json not found; point "
                                                "model.hf_assets_path at a Hugging Face model folder")
    other = {"llama3": "qwen3", "qwen3": "llama3"}[name]
    assert error(job_config(folder, "--model.name", other)) == (f"model.name: '{other}', but {folder}/config.json is a "
                                                                f"{arch}; set model.name = '{name}'")
    assert tokenizer_vocab_size(folder) == VOCAB
    assert error(job_config(folder, *model, "--model.flavor", "tiny")) == (
        f"model.hf_assets_path: the tokenizer has {VOCAB} token ids but the policy's embedding has 32 rows; use the "
        f"model's own tokenizer, or a model (model.flavor) with vocab_size >= {VOCAB}")
    assert error(job_config(folder, *model, "--checkpoint.initial_load_path", str(empty),
                            "--checkpoint.initial_load_in_hf")) == (
        f"checkpoint.initial_load_path: {empty} has no *.safetensors files; point it at a Hugging Face model folder "
        "(model.safetensors or the shards and model.safetensors.index.json)")
    assert error(job_config(folder, *model, "--checkpoint.initial_load_path", folder)) == (
        f"checkpoint.initial_load_path: '{folder}' is read as Hugging Face safetensors only; set "
        "checkpoint.initial_load_in_hf = true")

    (empty / "config.json").write_text(json.dumps({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}))
    assert error(job_config(empty, *model)) == (
        f"{empty}/config.json: architectures ['MistralForCausalLM'] (model_type 'mistral') is not supported with "
        "model.flavor 'hf'; use a checkpoint of LlamaForCausalLM or Qwen3ForCausalLM")
    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text(open(os.path.join(folder, "config.json")).read())
    assert error(job_config(no_tokenizer, *model)) == (
        f"model.hf_assets_path: {no_tokenizer}/tokenizer.json not found; the task tokenizes text with it: point "
        "model.hf_assets_path at the model's Hugging Face folder")
    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768}
    source = write_config(no_tokenizer, rope_parameters=yarn)
    assert error(job_config(no_tokenizer, *model)) == {
        "llama3": f"{source}: rope_type 'yarn' is not supported for LlamaForCausalLM; only 'llama3' scaling "
                  "(Llama-3.1+) or none is",
        "qwen3": f"{source}: rope_type 'yarn' is not supported for Qwen3ForCausalLM; torchtitan's qwen3 has no RoPE "
                 "scaling: remove rope_scaling (contexts up to max_position_embeddings need none)"}[name]
    assert family_of_args(model_args(name, "hf", SEQ_LEN, folder)).hf_architectures == (arch,)
