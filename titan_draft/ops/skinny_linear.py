"""x @ w.T for a few rows of x (decode steps), as one Triton kernel that streams w once, with its
dense reference (F.linear) beside it.

A batch-1 decode step multiplies 1 to 5 rows by every projection matrix: pure weight reads. On the
H200 cuBLAS's kernels for the Qwen3-1.7B block projections read at 40-75% of the bandwidth at one
row, some split over K with a separate reduction (docs/DECODE_STEP.md). Here each program owns
BLOCK_N output columns, i.e. BLOCK_N rows of w, and walks K in BLOCK_K steps, with all of x's rows
(at most BLOCK_M) as the rows of one tl.dot tile: each weight is read once, in long contiguous runs,
and the sum over K stays in one program (deterministic, no second kernel).

Inference only (the engine runs under no_grad): no backward. tests/test_skinny_linear.py compares it
to F.linear in float64 in Triton's interpreter on CPU, and in bf16 on a GPU.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# The most rows of x one launch takes: tl.dot's smallest tile.
MAX_ROWS = 16


def skinny_linear_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K].T -> [M, N]."""
    return F.linear(x, w)


@triton.jit
def _skinny_linear(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """Output columns [pid * BLOCK_N, +BLOCK_N) of all M rows: sum over K of x[m, k] w[n, k]."""
    m = tl.arange(0, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    compute = tl.float64 if x_ptr.dtype.element_ty == tl.float64 else tl.float32
    acc = tl.zeros([BLOCK_M, BLOCK_N], compute)
    for first in range(0, K, BLOCK_K):
        k = first + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        if IEEE:  # float32 inputs: no TF32 rounding
            acc += tl.dot(x, tl.trans(w), input_precision="ieee").to(compute)
        else:
            acc += tl.dot(x, tl.trans(w)).to(compute)
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(m[:, None] < M) & (n[None, :] < N))


def _config(N: int, K: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages), the fastest of bench/skinny_linear.py's sweep at the
    Qwen3-1.7B block projections on the H200: 16 rows of w per program where N is 2,048 (128 programs),
    32 above; reads of 512 columns, but 128 for the widest matrix (gate/up, 12,288 rows)."""
    block_n = 16 if N <= 2048 else 32
    block_k = 128 if N >= 8192 else 512
    return block_n, min(block_k, triton.next_power_of_2(K)), 4, 4


def launch(x: torch.Tensor, w: torch.Tensor, config: tuple[int, int, int, int]) -> torch.Tensor:
    """The kernel with an explicit (BLOCK_N, BLOCK_K, warps, stages): what skinny_linear runs with
    _config's choice, and what bench/skinny_linear.py sweeps."""
    M, K = x.shape
    N = w.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"skinny_linear: {M} rows; it takes at most {MAX_ROWS} (use F.linear)")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    block_n, block_k, warps, stages = config
    _skinny_linear[(triton.cdiv(N, block_n),)](
        x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=x.dtype == torch.float32, num_warps=warps,
        num_stages=stages)
    return out


@torch.library.custom_op("titan_draft::skinny_linear", mutates_args=())
def skinny_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """skinny_linear_reference's result for x [M <= MAX_ROWS, K] and w [N, K], both with a contiguous
    last dim. An opaque op for torch.compile."""
    return launch(x, w, _config(w.shape[0], x.shape[1]))


@skinny_linear.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[0])
