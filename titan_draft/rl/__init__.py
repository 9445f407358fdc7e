"""The RL algorithm: GRPO, the step's batch and sums, the policy holders (whole, pipelined), the warm start."""
