"""Context-parallel branch attention and the halo shift equal their single-process references.

One gloo process group per world size (2 and 4) runs every case; each rank computes the
single-process reference on the whole padded batch itself and compares its own rows, forward and
all gradients, in float64. The halo shifts come back to the test process, which unshards them and
compares with DocumentShift on the unpadded documents.
"""
import pytest
import torch

from distributed import run_distributed
from titan_draft.data.packing import cu_seqlens_from_lengths
from titan_draft.ops import branch_attention
from titan_draft.parallel import CpGroup, HaloShift, ZigzagLayout, cp_branch_attention, zigzag_shard, zigzag_unshard
from titan_draft.parallel.cp_attention import MODES, allgather_blocks, ring_blocks

PASSES = [None, 0, 1, 2, 3, 4, 5, 6]
Q_HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
MAX_SHIFT = 4
HALO_SEED = 7


def _random_lengths(generator, cp_size):
    """Odd original lengths (one of 1 row, so chunks are tiny), and their padded lengths."""
    lengths = (2 * torch.randint(0, 12, (4,), generator=generator) + 1).tolist() + [1]
    padded = [-(-n // (2 * cp_size)) * 2 * cp_size for n in lengths]
    return lengths, padded


def _max_diff(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _attention_errors(mesh, mode, passes, seed, dtype=torch.float64):
    """|CP - reference| of out, lse and every gradient on this rank's rows: max absolute in
    float64; for lower precision, relative to the largest reference value, the reference running
    in float64 on the same rounded inputs (and every result must come back in its input's dtype)."""
    cp_size, rank = mesh.size(), mesh.get_local_rank()
    generator = torch.Generator().manual_seed(seed)
    _, padded = _random_lengths(generator, cp_size)
    cu = cu_seqlens_from_lengths(padded)
    tokens = int(cu[-1])

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype).double()

    inputs = {"q": randn(tokens, Q_HEADS, HEAD_DIM), "k": randn(tokens, KV_HEADS, HEAD_DIM),
              "v": randn(tokens, KV_HEADS, HEAD_DIM)}
    if passes is not None:
        inputs["branch_k"] = randn(passes, tokens, KV_HEADS, HEAD_DIM)
        inputs["branch_v"] = randn(passes, tokens, KV_HEADS, HEAD_DIM)
    grad_out = randn(tokens, Q_HEADS, HEAD_DIM)

    reference = {name: x.clone().requires_grad_() for name, x in inputs.items()}
    out, lse = branch_attention(**reference, cu_seqlens=cu)
    (out * grad_out).sum().backward()

    def local(x, dim=0):
        return zigzag_shard(x, cu, cp_size, rank, dim)

    dims = {"branch_k": 1, "branch_v": 1}
    mine = {name: local(x, dims.get(name, 0)).to(dtype).requires_grad_() for name, x in inputs.items()}
    cp_out, cp_lse = cp_branch_attention(**mine, cu_seqlens=cu, cp=CpGroup(mesh, mode))
    (cp_out * local(grad_out).to(dtype)).sum().backward()

    def error(value, expected):
        scale = 1.0 if dtype == torch.float64 else max(expected.abs().max().item(), 1e-30)
        return _max_diff(value, expected) / scale

    errors = {"out": error(cp_out, local(out)), "lse": error(cp_lse, local(lse, 1))}
    for name, x in mine.items():
        errors["d" + name] = error(x.grad, local(reference[name].grad, dims.get(name, 0)))
    dtypes_ok = cp_out.dtype == dtype and cp_lse.dtype == torch.promote_types(dtype, torch.float32) and \
        all(x.grad.dtype == dtype for x in mine.values())
    errors["wrong_dtype"] = float(not dtypes_ok)
    return errors


def _halo_case(cp_size, seed):
    """Odd real lengths, their padded boundaries, the real rows in the padded layout, x, grads."""
    generator = torch.Generator().manual_seed(seed)
    lengths, padded = _random_lengths(generator, cp_size)
    cu = cu_seqlens_from_lengths(padded)
    real_rows = torch.cat([torch.arange(start, start + n) for start, n in zip(cu[:-1].tolist(), lengths)])
    x = torch.randn(int(cu[-1]), 3, generator=generator, dtype=torch.float64)
    grads = torch.randn(MAX_SHIFT + 1, *x.shape, generator=generator, dtype=torch.float64)
    return lengths, cu, real_rows, x, grads


def _halo_shifts(mesh, seed):
    """This rank's HaloShift outputs, input gradients and shifted bool masks for d = 0..MAX_SHIFT."""
    cp_size, rank = mesh.size(), mesh.get_local_rank()
    lengths, cu, _, x, grads = _halo_case(cp_size, seed)
    shift = HaloShift(cu, mesh, MAX_SHIFT, doc_lengths=torch.tensor(lengths))
    results = []
    for d in range(MAX_SHIFT + 1):
        x_local = zigzag_shard(x, cu, cp_size, rank).requires_grad_()
        shifted = shift(x_local, d)
        (shifted * zigzag_shard(grads[d], cu, cp_size, rank)).sum().backward()
        mask = shift(zigzag_shard(torch.arange(len(x)) % 2 == 0, cu, cp_size, rank), d)
        results.append((shifted.detach(), x_local.grad, mask))
    return results


def _all_cases(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    results = {(mode, passes): _attention_errors(mesh, mode, passes, seed=100 + i)
               for mode in MODES for i, passes in enumerate(PASSES)}
    for mode in MODES:
        results[(mode, "bf16")] = _attention_errors(mesh, mode, 3, seed=200, dtype=torch.bfloat16)
    results["halo"] = _halo_shifts(mesh, seed=HALO_SEED)
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"cp{w}")
def results(request):
    return run_distributed(_all_cases, request.param, timeout=150)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("passes", PASSES, ids=lambda p: f"P{p}")
def test_cp_branch_attention_matches_single_process(results, mode, passes):
    for rank, result in enumerate(results):
        errors = result[(mode, passes)]
        assert set(errors) >= {"out", "lse", "dq", "dk", "dv"}
        assert max(errors.values()) < 1e-10, f"rank {rank}: {errors}"


@pytest.mark.parametrize("mode", MODES)
def test_cp_branch_attention_in_bfloat16(results, mode):
    # The fp32 merge and accumulators keep CP as accurate as the single-process op: both within
    # bf16 rounding of the float64 result, and every output in its input's dtype.
    for rank, result in enumerate(results):
        errors = result[(mode, "bf16")]
        assert errors.pop("wrong_dtype") == 0.0, f"rank {rank}"
        assert max(errors.values()) < 2e-2, f"rank {rank}: {errors}"


def test_halo_shift_matches_document_shift(results):
    # The reference runs here, on the unpadded rows: shifted values, gradients and bool masks of
    # HaloShift, unsharded, must equal DocumentShift's (zeros past every real document end).
    from titan_draft.data.packing import DocumentShift

    lengths, cu, real_rows, x, grads = _halo_case(len(results), HALO_SEED)
    reference_shift = DocumentShift(cu_seqlens_from_lengths(lengths))
    for d in range(MAX_SHIFT + 1):
        x_ref = x.clone().requires_grad_()
        expected = torch.zeros_like(x)
        expected[real_rows] = reference_shift(x_ref[real_rows], d)
        (expected * grads[d]).sum().backward()
        shifted, x_grad, mask = (zigzag_unshard([r["halo"][d][i] for r in results], cu) for i in range(3))
        assert _max_diff(shifted, expected) == 0.0, f"d = {d}"
        assert _max_diff(x_grad, x_ref.grad) < 1e-15, f"d = {d}"
        expected_mask = torch.zeros(len(x), dtype=torch.bool)
        expected_mask[real_rows] = reference_shift(torch.arange(len(x))[real_rows] % 2 == 0, d)
        assert mask.dtype == torch.bool and torch.equal(mask, expected_mask), f"d = {d}"


def _pairs(blocks, layout, kv_rows_of):
    """(global query row, global key row) pairs a block schedule covers, with multiplicity."""
    rows = layout.global_rows()
    pairs = []
    for block, kv_global in zip(blocks, kv_rows_of):
        q_global = rows if block.q_rows is None else rows[block.q_rows]
        k_global = kv_global if block.kv_rows is None else kv_global[block.kv_rows]
        varlen = block.varlen
        for cu_q, cu_k, q_doc, k_doc in zip(varlen.cu_q.tolist(), varlen.cu_k.tolist(),
                                            varlen.cu_q[1:].tolist(), varlen.cu_k[1:].tolist()):
            for i, qi in enumerate(q_global[cu_q:q_doc].tolist()):
                for j, kj in enumerate(k_global[cu_k:k_doc].tolist()):
                    if not varlen.causal or j <= i:
                        pairs.append((qi, kj))
    return pairs


@pytest.mark.parametrize("cp_size", [2, 3, 4, 8])
def test_schedules_cover_the_causal_mask_exactly_once(cp_size):
    # Pure index arithmetic: every (query, key) pair of the causal document mask is computed by
    # exactly one block on the query's rank, in both modes.
    cu = cu_seqlens_from_lengths([2 * cp_size * n for n in (1, 3, 2)])
    document = torch.repeat_interleave(torch.arange(3), cu.diff().long())
    for rank in range(cp_size):
        layout = ZigzagLayout(cu, cp_size, rank)
        expected = sorted((i, j) for i in layout.global_rows().tolist() for j in range(int(cu[-1]))
                          if document[i] == document[j] and j <= i)
        ring = ring_blocks(layout)
        ring_kv = [layout.global_rows((rank - step) % cp_size) for step in range(len(ring))]
        assert sorted(_pairs(ring, layout, ring_kv)) == expected
        gathered = torch.cat([layout.global_rows(j) for j in range(cp_size)])
        blocks = allgather_blocks(layout)
        assert sorted(_pairs(blocks, layout, [gathered] * len(blocks))) == expected


class _FakeMesh:
    """Stands in for a 1-D DeviceMesh where only the argument checks run."""
    ndim = 1

    def size(self):
        return 2

    def get_local_rank(self):
        return 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(mode="ulysses"), "mode: 'ulysses'"),
    (dict(cp_mesh=None), "cp_mesh: needs a 1-D DeviceMesh"),
    (dict(cu_seqlens=torch.tensor([0, 8])), "cu_seqlens: needs the GLOBAL padded"),
    (dict(cu_seqlens=torch.tensor([0, 6], dtype=torch.int32)), "not a multiple of 2 \\* cp_size = 4"),
    (dict(cu_seqlens=torch.tensor([0, 16], dtype=torch.int32)), "q: 4 rows, but the global cu_seqlens give 8"),
])
def test_bad_arguments_raise_one_clear_error(kwargs, message):
    q, k = torch.randn(4, 4, 8), torch.randn(4, 2, 8)
    call = {**dict(cu_seqlens=torch.tensor([0, 8], dtype=torch.int32), cp_mesh=_FakeMesh(), mode="ring"), **kwargs}
    with pytest.raises(ValueError, match=message):
        cp_branch_attention(q, k, k, cu_seqlens=call["cu_seqlens"], cp=CpGroup(call["cp_mesh"], call["mode"]))


def test_context_parallel_rejects_unknown_mode():
    from titan_draft.data.packing import pack
    from titan_draft.models.policy import build_policy
    from titan_draft.parallel import apply_context_parallel, shard_batch_for_cp

    batch = pack([torch.arange(5)], [torch.ones(5)])
    with pytest.raises(ValueError, match="draft.cp_mode: 'zigzag' is not supported"):
        shard_batch_for_cp(batch, _FakeMesh(), "zigzag")
    with pytest.raises(ValueError, match="draft.cp_mode: 'zigzag' is not supported"):
        apply_context_parallel(build_policy("llama3", "tiny", 16), _FakeMesh(), "zigzag")
