"""rlpost: online RL post-training of text-to-image flow-matching models.

This module is the declared plugin API (pytest's model, ``from pytest import ...``): everything a plugin may import
is exported here, and first-party plugins import nothing else of rlpost (``tests/meta/test_import_graph.py``)::

    from rlpost import hookimpl, RewardSource

What each name is and how stable it is: ``docs/writing_plugins.md``. The layers behind it (``rlpost.core``,
``rlpost.ops``, ``rlpost.components``, ``rlpost.models``, ``rlpost.engine``, ``rlpost.apps``) are internal and may move;
the names here may not without a deprecation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlpost.components.chain import (
    DPM_SOLVER,
    ChainPlan,
    broadcast_to_edges,
    chain_counts,
    edge_sample_ids,
    last_steps_kernels,
    last_steps_problems,
    random_step_subset,
    rollout_chains,
    run_chains,
    shared_or_independent_noise,
)
from rlpost.components.clean_samples import CleanBatch, clean_batch, sample_chunks
from rlpost.components.clipped_surrogate import ClippedSurrogate
from rlpost.core.api import (
    CHAINS,
    CLEAN_SAMPLES,
    EDGE_LOG_PROBS,
    EDGE_OLD_MEANS,
    REFERENCE,
    TREE,
    AdvantageEstimator,
    Advantages,
    Component,
    Conditioning,
    EdgeEval,
    HubFiles,
    InvalidArguments,
    Policy,
    PolicyOptimizer,
    PromptSource,
    Range,
    RewardSource,
    Sampler,
    StepCounts,
    TrainBackend,
    TrainCounts,
    UpdateContext,
    UpdateResult,
    WeightCopies,
    resolve_guidance,
)
from rlpost.core.context import RecipeView, RunContext, RunSettings, RunStatus
from rlpost.core.contract import PromptBatch, RewardScores, Rollout, Stash, StashKey
from rlpost.core.hookspecs import hookimpl
from rlpost.core.registry import Registry
from rlpost.core.shipped import shipped_asset
from rlpost.engine.lr_schedule import RunLengthLR
from rlpost.ops.dpm_solver import dpm_solver_pp2_step
from rlpost.ops.kernels import EulerODE, LogProbReduction, StepKernel, make_kernel
from rlpost.ops.likelihood_free import (
    ADAPTIVE_WEIGHT_FLOOR,
    NFTTerms,
    adaptive_x0_loss,
    implicit_policies,
    nft_loss,
    optimality_weight,
)
from rlpost.ops.reward_mixing import constant_groups, mix_rewards
from rlpost.ops.sampling import RolloutBuilder, evaluate_edges, frontier_velocity
from rlpost.ops.schedules import (
    TIME_GRIDS,
    TimeGrid,
    clean_tail_steps,
    shifted_linspace_sigmas,
    shifted_tail_sigmas,
    subsampled_indices,
    time_shift,
    timesteps_from_sigmas,
)
from rlpost.ops.training_noise import (
    grid_permutations,
    keyed_generator,
    noise_for,
    renoise,
    sample_keys,
    stratified_indices,
    subset_without_replacement,
)
from rlpost.ops.trees import (
    DPM_TAIL_KERNEL,
    PROGRESSIVE_DEFAULTS,
    NoiseSource,
    PerGroupNoise,
    SharedNoise,
    TailGrid,
    TailSolver,
    TailStepper,
    Weighting,
    WindowLaw,
    WindowSettings,
    backup_values,
    branch_children,
    calibrated_weights,
    descendant_leaf_totals,
    draw_window_start,
    edge_levels,
    expected_value,
    grouped_ess,
    leaves_below,
    num_starts,
    progressive_setting,
    progressive_start,
    progressive_starts,
    tail_nfe,
    tail_problems,
    tail_sigmas,
    window_law_problems,
    window_law_probs,
    window_law_repr,
    window_law_start,
    window_probs,
)

if TYPE_CHECKING:  # imported on first use (below): they pull in diffusers/transformers
    from rlpost.models._common import DiffusersTransformerPolicy, PromptCache
    from rlpost.models.adapter_settings import DTypeName, LoraSpec, resolve_dtype
    from rlpost.models.flux import FluxPolicy
    from rlpost.models.packed_latents import PackedLatentPolicy, flux_mu, flux_sigmas, pack_latents, unpack_latents
    from rlpost.models.pipeline_dir import cached_snapshot, check_pipeline_dir, read_config
    from rlpost.models.sd3 import SD3Policy
    from rlpost.models.tiny import assemble_sd3_pipeline, ensure_tiny_model
    from rlpost.models.tiny_text import build_clip_tokenizer, build_text_encoders, sd3_tokenizers, t5_vocab

__all__ = [
    "CHAINS",
    "CLEAN_SAMPLES",
    "EDGE_LOG_PROBS",
    "EDGE_OLD_MEANS",
    "REFERENCE",
    "TREE",
    "AdvantageEstimator",
    "Advantages",
    "ChainPlan",
    "ClippedSurrogate",
    "Component",
    "Conditioning",
    "DPM_SOLVER",
    "DTypeName",
    "DiffusersTransformerPolicy",
    "EdgeEval",
    "EulerODE",
    "HubFiles",
    "FluxPolicy",
    "InvalidArguments",
    "LogProbReduction",
    "LoraSpec",
    "PackedLatentPolicy",
    "Policy",
    "PolicyOptimizer",
    "PromptBatch",
    "PromptCache",
    "PromptSource",
    "Range",
    "RecipeView",
    "Registry",
    "RewardScores",
    "RewardSource",
    "Rollout",
    "RolloutBuilder",
    "RunContext",
    "RunLengthLR",
    "RunSettings",
    "RunStatus",
    "SD3Policy",
    "Sampler",
    "Stash",
    "StashKey",
    "StepCounts",
    "StepKernel",
    "TIME_GRIDS",
    "TimeGrid",
    "TrainBackend",
    "TrainCounts",
    "UpdateContext",
    "UpdateResult",
    "WeightCopies",
    "__version__",
    "assemble_sd3_pipeline",
    "broadcast_to_edges",
    "build_clip_tokenizer",
    "build_text_encoders",
    "cached_snapshot",
    "chain_counts",
    "check_pipeline_dir",
    "clean_tail_steps",
    "constant_groups",
    "dpm_solver_pp2_step",
    "edge_sample_ids",
    "ensure_tiny_model",
    "evaluate_edges",
    "flux_mu",
    "flux_sigmas",
    "frontier_velocity",
    "hookimpl",
    "last_steps_kernels",
    "last_steps_problems",
    "make_kernel",
    "mix_rewards",
    "pack_latents",
    "random_step_subset",
    "resolve_dtype",
    "resolve_guidance",
    "rollout_chains",
    "run_chains",
    "sd3_tokenizers",
    "shipped_asset",
    "shared_or_independent_noise",
    "shifted_linspace_sigmas",
    "shifted_tail_sigmas",
    "subsampled_indices",
    "t5_vocab",
    "time_shift",
    "timesteps_from_sigmas",
    "unpack_latents",
    "read_config",
    "CleanBatch",
    "clean_batch",
    "sample_chunks",
    "grid_permutations",
    "keyed_generator",
    "noise_for",
    "renoise",
    "sample_keys",
    "stratified_indices",
    "subset_without_replacement",
    "DPM_TAIL_KERNEL",
    "PROGRESSIVE_DEFAULTS",
    "NoiseSource",
    "PerGroupNoise",
    "SharedNoise",
    "TailGrid",
    "TailSolver",
    "TailStepper",
    "Weighting",
    "WindowLaw",
    "WindowSettings",
    "backup_values",
    "branch_children",
    "calibrated_weights",
    "descendant_leaf_totals",
    "draw_window_start",
    "expected_value",
    "grouped_ess",
    "edge_levels",
    "leaves_below",
    "ADAPTIVE_WEIGHT_FLOOR",
    "NFTTerms",
    "adaptive_x0_loss",
    "implicit_policies",
    "nft_loss",
    "optimality_weight",
    "num_starts",
    "progressive_setting",
    "progressive_start",
    "progressive_starts",
    "tail_nfe",
    "tail_problems",
    "tail_sigmas",
    "window_law_probs",
    "window_law_problems",
    "window_law_repr",
    "window_law_start",
    "window_probs",
]

# Exported names whose modules load on first access (PEP 562), so ``import rlpost`` stays cheap.
_LAZY = {
    "DiffusersTransformerPolicy": "rlpost.models._common",
    "DTypeName": "rlpost.models.adapter_settings",
    "FluxPolicy": "rlpost.models.flux",
    "LoraSpec": "rlpost.models.adapter_settings",
    "PackedLatentPolicy": "rlpost.models.packed_latents",
    "PromptCache": "rlpost.models._common",
    "SD3Policy": "rlpost.models.sd3",
    "build_clip_tokenizer": "rlpost.models.tiny_text",
    "cached_snapshot": "rlpost.models.pipeline_dir",
    "check_pipeline_dir": "rlpost.models.pipeline_dir",
    "read_config": "rlpost.models.pipeline_dir",
    "resolve_dtype": "rlpost.models.adapter_settings",
    "assemble_sd3_pipeline": "rlpost.models.tiny",
    "build_text_encoders": "rlpost.models.tiny_text",
    "ensure_tiny_model": "rlpost.models.tiny",
    "flux_mu": "rlpost.models.packed_latents",
    "flux_sigmas": "rlpost.models.packed_latents",
    "pack_latents": "rlpost.models.packed_latents",
    "unpack_latents": "rlpost.models.packed_latents",
    "sd3_tokenizers": "rlpost.models.tiny_text",
    "t5_vocab": "rlpost.models.tiny_text",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    # Resolve the version lazily from the installed metadata (pluggy's pattern): importing rlpost stays cheap.
    if name == "__version__":
        import importlib.metadata

        try:
            return importlib.metadata.version("rlpost")
        except importlib.metadata.PackageNotFoundError:
            return "0+unknown"
    raise AttributeError(name)
