"""RoPE over adjacent feature pairs (torchtitan llama3's convention, which the EAGLE-3 draft shares),
computed on real numbers.

torchtitan's llama3 `apply_rotary_emb` reads each pair (x0, x1) of a head as the complex number
x0 + i x1 and multiplies it by freqs_cis[position] = cos + i sin. torch.compile generates no code
for complex tensors: in a compiled function every complex op (the table's gather, the two products,
the casts) runs as an eager kernel of its own, in every block of every decode step. `rotate_pairs`
writes the same products on the real and imaginary parts, x0 cos - x1 sin and x0 sin + x1 cos, in
float32 as torchtitan does, so they fuse with the kernels around them. Only the complex table's
real view remains, which costs no kernel. tests/test_rope.py checks that it equals torchtitan's
function bit for bit, forward and gradients, and that a compiled call runs no eager op but that view.
"""
import torch


def rotate_pairs(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor,
                 positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """torchtitan llama3's apply_rotary_emb(xq, xk, freqs_cis, positions) on real numbers.

    xq [B, S, Hq, D], xk [B, S, Hkv, D]; freqs_cis [L, D / 2] complex (torchtitan's
    precompute_freqs_cis); positions: None (0..S-1), [1, S] (every row) or [B, S]."""
    table = torch.view_as_real(freqs_cis)  # [L, D / 2, (cos, sin)]
    table = table[: xq.shape[1]][None] if positions is None else table[positions]
    cos, sin = table[..., 0].unsqueeze(2), table[..., 1].unsqueeze(2)  # [1 or B, S, 1, D / 2]

    def rotate(x):
        pairs = x.float().unflatten(-1, (-1, 2))
        real, imag = pairs[..., 0], pairs[..., 1]
        return torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1).flatten(-2).type_as(x)

    return rotate(xq), rotate(xk)
