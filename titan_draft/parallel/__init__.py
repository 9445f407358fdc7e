"""Parallelism beyond torchtitan's: branch-aware context parallelism for packed documents."""
from titan_draft.parallel.context_parallel import ContextShard, apply_context_parallel, global_count, shard_batch_for_cp
from titan_draft.parallel.cp_attention import CpGroup, cp_branch_attention
from titan_draft.parallel.halo import HaloShift
from titan_draft.parallel.zigzag import (
    ZigzagLayout,
    pad_documents,
    shard_batch,
    zigzag_rows,
    zigzag_shard,
    zigzag_unshard,
)
from titan_draft.parallel.pipeline import CoTrainLoss, CoTrainSpec, PipelineCoTrain, TapStage, build_pipeline_cotrain
from titan_draft.parallel.tap_channel import TapChannel
