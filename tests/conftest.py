"""The suite is CI's CPU suite on any machine: its job-level tests build jobs on the device titan_draft
picks (a visible GPU: bf16 under FSDP2, which wants torchrun's process group) and compare them in
float64. So a GPU is hidden from the tests, and the processes they start, before torch first looks for
one; TITAN_DRAFT_GPU_TESTS=1 leaves it visible, for the GPU kernels' test files (docs/RESULTS.md,
"What the tests check")."""
import os

if os.environ.get("TITAN_DRAFT_GPU_TESTS") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
