"""torchtitan's [compile] on the policy: each block compiled whole ("model"; fullgraph, so a graph break
fails) and the LM head's chunked log-probs ("loss") give the eager policy's RL step, gradients and metrics
in float64, over micro-batches of changing shapes and under activation checkpointing (full for qwen3, selective
and memory_budget for llama3; without it in tests/test_parallel_compose.py's pipeline layout); the packed attention
op the compiled blocks call passes torch.library's own checks (schema, fake tensors, autograd), and selective
op-level activation checkpointing keeps its output instead of running it again."""
import os
import sys

import pytest
import torch
from torch._dynamo.eval_frame import OptimizedModule

from titan_draft.ops.branch_attention import branch_attention_reference

sys.path.insert(0, os.path.dirname(__file__))
from test_microbatch import LEVERS, assert_same, float64, step  # noqa: E402, F401  (float64: an autouse fixture)

COMPILE = ["--compile.enable"]  # torchtitan's default components: "model" and "loss"


@pytest.mark.parametrize("device, dtype", [
    ("cpu", torch.float64),
    pytest.param("cuda", torch.bfloat16, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")),
])
def test_packed_attention_op_passes_opcheck_and_equals_the_dense_reference(device, dtype):
    """On CPU in float64 (the math backend); on a GPU in bf16 (cuDNN or FlashAttention: the kernels a
    compiled block calls, whose outputs must match the op's fake ones)."""
    torch.manual_seed(0)
    head_dim = 8 if dtype == torch.float64 else 64
    q = torch.randn(11, 4, head_dim, dtype=dtype, device=device, requires_grad=True)
    k, v = (torch.randn(11, 2, head_dim, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
    cu_seqlens = torch.tensor([0, 4, 4, 11], dtype=torch.int32, device=device)  # an empty document among them
    torch.library.opcheck(torch.ops.titan_draft.packed_attention, (q, k, v, cu_seqlens, 0.3))
    out, lse = torch.ops.titan_draft.packed_attention(q, k, v, cu_seqlens, 0.3)
    want, want_lse = branch_attention_reference(q, k, v, cu_seqlens=cu_seqlens, scale=0.3)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    tol = {} if dtype == torch.float64 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, want, **tol)
    torch.testing.assert_close(lse, want_lse, **tol)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, **tol)


@pytest.mark.parametrize("model, ac", [("qwen3", "full"), ("llama3", "selective"), ("llama3", "memory_budget")])
def test_compiled_blocks_leave_the_step_unchanged(model, ac):
    """The cotrain step (policy, reference and draft) in micro-batches: eager against compiled blocks
    (memory_budget, which needs them, against eager full checkpointing)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    overrides = [*LEVERS, "--model.name", model]
    eager = step(*overrides, "--activation_checkpoint.mode", "full" if ac == "memory_budget" else ac)
    budget = torch._functorch.config.activation_memory_budget
    with torch._functorch.config.patch(activation_memory_budget=budget):  # memory_budget sets it process-wide
        compiled = step(*overrides, "--activation_checkpoint.mode", ac, *COMPILE)
    policy = compiled[3].policy.parts[0]
    assert all(isinstance(block, OptimizedModule) for block in policy.layers.values()) and policy.output.compiled
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # they ran compiled
    assert_same(eager, compiled)


AC = "--activation_checkpoint.mode"
AC_MODES = {"none": [AC, "none"], "full": [AC, "full"],
            **{option: [AC, "selective", "--activation_checkpoint.selective_ac_option", option] for option in ("op", "2")}}


@pytest.mark.parametrize("ac, calls", [("none", 4), ("op", 4), ("2", 6), ("full", 8)])
def test_selective_checkpointing_keeps_the_attention_output(ac, calls):
    """Forward + backward of 4 layers: selective op-level checkpointing ("op") saves the packed attention op's
    output, as torchtitan saves its own attention ops' (one call per layer); selective layer checkpointing
    ("2": every second layer) and full checkpointing run it again in the layers they checkpoint."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from titan_draft.config import parse_config
    from titan_draft.data.packing import pack_documents
    from titan_draft.models.policy import build_policy, forward_packed
    from titan_draft.parallel.parallelize import apply_activation_checkpointing

    class CountAttention(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CountAttention.calls += func is torch.ops.titan_draft.packed_attention.default
            return func(*args, **(kwargs or {}))

    cfg = parse_config(["--job.config_file", os.path.join(os.path.dirname(__file__), "..", "train_configs",
                                                          "sort_tiny_cpu.toml"), *AC_MODES[ac]])
    policy = apply_activation_checkpointing(build_policy("llama3", "tiny", 32, seed=0, device="cpu"), cfg)
    batch = pack_documents([torch.randint(0, 32, (n,)) for n in (9, 5)], torch.tensor([2, 3]))
    with CountAttention():
        forward_packed(policy, batch).sum().backward()
    assert len(policy.layers) == 4 and CountAttention.calls == calls
