"""linear_token_outputs: the chunked path against the dense reference (forward, teacher, gradients of hidden and
weight), R = 0, autocast, and that the chunked forward keeps nothing of R x V elements for the backward."""
import pytest
import torch
import torch.nn.functional as F

from titan_draft.ops.linear_logprobs import linear_token_outputs

ROWS, HIDDEN, VOCAB = 10, 6, 37


def make_inputs(rows=ROWS, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, HIDDEN, generator=generator, dtype=dtype).requires_grad_()
    weight = torch.randn(VOCAB, HIDDEN, generator=generator, dtype=dtype).requires_grad_()
    targets = torch.randint(VOCAB, (rows,), generator=generator)
    upstream = torch.randn(rows, generator=generator, dtype=dtype)  # a random gradient on the log-probs
    return hidden, weight, targets, upstream


def outputs_and_grads(hidden, weight, targets, upstream, **kwargs):
    out = linear_token_outputs(hidden, weight, targets, **kwargs)
    grads = torch.autograd.grad((out.logprobs * upstream.to(out.logprobs.dtype)).sum(), (hidden, weight))
    return out, grads


def assert_same(chunked, dense, tol):
    (out, grads), (ref, ref_grads) = chunked, dense
    for name in ("logprobs", "entropy", "teacher_logits"):
        torch.testing.assert_close(getattr(out, name), getattr(ref, name), rtol=tol, atol=tol, msg=name)
    assert torch.equal(out.teacher_argmax, ref.teacher_argmax)
    for grad, ref_grad, name in zip(grads, ref_grads, ("hidden", "weight")):
        assert grad.dtype == ref_grad.dtype
        torch.testing.assert_close(grad, ref_grad, rtol=tol, atol=tol, msg=f"grad of {name}")


TEACHER_IDS = torch.tensor([3, 0, 36, 17, 8])


@pytest.mark.parametrize("chunk_size", [1, 3, ROWS, ROWS + 5])
def test_chunked_equals_dense_float64(chunk_size):
    inputs = make_inputs()
    dense = outputs_and_grads(*inputs, teacher_ids=TEACHER_IDS)
    chunked = outputs_and_grads(*inputs, chunk_size=chunk_size, teacher_ids=TEACHER_IDS)
    assert_same(chunked, dense, tol=1e-10)
    out, (grad_hidden, grad_weight) = dense
    # The reference itself is what the callers computed from full logits before.
    logits = inputs[0] @ inputs[1].T
    torch.testing.assert_close(out.logprobs, -F.cross_entropy(logits, inputs[2], reduction="none"))
    assert out.teacher_logits.shape == (ROWS, len(TEACHER_IDS))
    torch.testing.assert_close(out.teacher_logits, logits[:, TEACHER_IDS].detach())
    assert torch.equal(out.teacher_argmax, logits.argmax(-1))
    assert (out.entropy > 0).all() and not out.entropy.requires_grad
    assert grad_hidden.abs().sum() > 0 and grad_weight.abs().sum() > 0


@pytest.mark.parametrize("chunk_size", [1, 3, ROWS + 5])
def test_teacher_rows_unsorted_with_duplicates(chunk_size):
    inputs = make_inputs(seed=1)
    teacher_rows = torch.tensor([7, 2, 9, 2, 0])
    dense = outputs_and_grads(*inputs, teacher_ids=TEACHER_IDS, teacher_rows=teacher_rows)
    chunked = outputs_and_grads(*inputs, chunk_size=chunk_size, teacher_ids=TEACHER_IDS, teacher_rows=teacher_rows)
    assert_same(chunked, dense, tol=1e-10)
    assert chunked[0].teacher_logits.shape == (5, len(TEACHER_IDS))
    logits = (inputs[0] @ inputs[1].T).detach()
    torch.testing.assert_close(chunked[0].teacher_logits, logits[teacher_rows][:, TEACHER_IDS], rtol=0, atol=1e-12)


def test_no_teacher_and_rows_out_of_range():
    inputs = make_inputs()
    for chunk_size in (0, 4):
        out = linear_token_outputs(*inputs[:3], chunk_size=chunk_size)
        assert out.teacher_logits is None and out.teacher_argmax is None
    with pytest.raises(ValueError, match="teacher_rows"):
        linear_token_outputs(*inputs[:3], chunk_size=4, teacher_ids=TEACHER_IDS, teacher_rows=torch.tensor([ROWS]))


@pytest.mark.parametrize("chunk_size", [0, 4])
def test_zero_rows(chunk_size):
    hidden, weight, targets, upstream = make_inputs(rows=0)
    out, (grad_hidden, grad_weight) = outputs_and_grads(hidden, weight, targets, upstream, chunk_size=chunk_size,
                                                        teacher_ids=TEACHER_IDS)
    assert out.logprobs.shape == out.entropy.shape == out.teacher_argmax.shape == (0,)
    assert out.teacher_logits.shape == (0, len(TEACHER_IDS))
    assert grad_hidden.shape == (0, HIDDEN)
    assert torch.equal(grad_weight, torch.zeros(VOCAB, HIDDEN, dtype=torch.float64))


@pytest.mark.parametrize("autocast", [False, True])
def test_compiled_chunk_math_equals_dense(autocast):
    """[compile] components "loss": each chunk's statistics and logits' gradient through torch.compile, in
    float64 and with bf16 logits under autocast; chunks of 3 rows leave a shorter last one."""
    inputs = make_inputs(dtype=torch.float32 if autocast else torch.float64, seed=4)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        dense = outputs_and_grads(*inputs, teacher_ids=TEACHER_IDS)
        compiled = outputs_and_grads(*inputs, chunk_size=3, teacher_ids=TEACHER_IDS, compiled=True)
    assert_same(compiled, dense, tol=2e-2 if autocast else 1e-10)


def test_chunked_equals_dense_float32():
    inputs = make_inputs(dtype=torch.float32, seed=2)
    dense = outputs_and_grads(*inputs, teacher_ids=TEACHER_IDS)
    chunked = outputs_and_grads(*inputs, chunk_size=3, teacher_ids=TEACHER_IDS)
    assert chunked[0].logprobs.dtype == torch.float32
    assert_same(chunked, dense, tol=1e-5)


def test_autocast_bfloat16_casts_both_paths_alike():
    # Float32 leaves under CPU autocast: both paths compute bf16 logits, float32 statistics.
    inputs = make_inputs(dtype=torch.float32, seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dense = outputs_and_grads(*inputs, teacher_ids=TEACHER_IDS)
        chunked = outputs_and_grads(*inputs, chunk_size=3, teacher_ids=TEACHER_IDS)
    out, grads = chunked
    assert out.logprobs.dtype == out.entropy.dtype == torch.float32
    assert out.teacher_logits.dtype == dense[0].teacher_logits.dtype == torch.bfloat16
    assert grads[0].dtype == grads[1].dtype == torch.float32  # back through the cast to the float32 leaves
    assert_same(chunked, dense, tol=2e-2)
    # Really bf16 logits: away from the float32 result by more than float32 rounding.
    exact = linear_token_outputs(*inputs[:3])
    assert (out.logprobs - exact.logprobs).abs().max() > 1e-4


def saved_numels(fn):
    """numel of every tensor autograd saves for the backward while fn() runs."""
    numels = []

    def pack(tensor):
        numels.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return numels


def test_chunked_forward_saves_nothing_of_rows_times_vocab():
    rows = 40  # rows * VOCAB above every input's size: an R x V tensor stands out
    hidden, weight, targets, _ = make_inputs(rows=rows)
    dense = saved_numels(lambda: linear_token_outputs(hidden, weight, targets, teacher_ids=TEACHER_IDS))
    assert max(dense) >= rows * VOCAB  # the hooks do see the dense path's logits
    chunked = saved_numels(lambda: linear_token_outputs(hidden, weight, targets, chunk_size=8,
                                                        teacher_ids=TEACHER_IDS))
    # hidden, weight, targets and the logsumexp [R]: nothing else.
    assert sorted(chunked) == sorted([rows * HIDDEN, VOCAB * HIDDEN, rows, rows])
    assert max(chunked) < rows * VOCAB


def test_frozen_weight_gets_no_gradient():
    hidden, weight, targets, upstream = make_inputs()
    weight = weight.detach()
    dense = linear_token_outputs(hidden, weight, targets).logprobs
    chunked = linear_token_outputs(hidden, weight, targets, chunk_size=3).logprobs
    (ref,) = torch.autograd.grad((dense * upstream).sum(), hidden)
    (grad,) = torch.autograd.grad((chunked * upstream).sum(), hidden)
    torch.testing.assert_close(grad, ref, rtol=1e-10, atol=1e-10)
