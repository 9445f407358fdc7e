"""Attention operators: the draft's branch attention and the block primitives it is built on."""
from titan_draft.ops.attention_kernels import (
    Varlen,
    add_branch,
    attn_backward,
    attn_forward,
    available_backends,
    branch_backward,
    branch_forward,
    merge_attn,
)
from titan_draft.ops.branch_attention import branch_attention, branch_attention_reference

__all__ = [
    "Varlen",
    "add_branch",
    "attn_backward",
    "attn_forward",
    "available_backends",
    "branch_attention",
    "branch_attention_reference",
    "branch_backward",
    "branch_forward",
    "merge_attn",
]
