"""What tree samplers share: window-start laws, tails, per-group noise and backups of leaf values.

TreeGRPO (``plugins/rlpost_treegrpo``), BranchGRPO and TempFlow-GRPO all grow a search tree over the denoising
schedule (an ODE trunk, stochastic branching on some steps, deterministic completion of every child) and credit its
edges from the rewards of the samples below them. The pieces they share live here, once, and reach plugins through
the ``rlpost`` facade.
"""

from rlpost.ops.trees.backup import (
    Weighting,
    backup_values,
    calibrated_weights,
    descendant_leaf_totals,
    edge_levels,
    grouped_ess,
    leaves_below,
)
from rlpost.ops.trees.frontier import branch_children
from rlpost.ops.trees.noise import NoiseSource, PerGroupNoise, SharedNoise
from rlpost.ops.trees.tails import (
    DPM_TAIL_KERNEL,
    TailGrid,
    TailSolver,
    TailStepper,
    tail_nfe,
    tail_problems,
    tail_sigmas,
)
from rlpost.ops.trees.window import (
    PROGRESSIVE_DEFAULTS,
    WindowLaw,
    WindowSettings,
    draw_window_start,
    expected_value,
    num_starts,
    progressive_setting,
    progressive_start,
    progressive_starts,
    window_law_problems,
    window_law_probs,
    window_law_repr,
    window_law_start,
    window_probs,
)

__all__ = [
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
    "leaves_below",
    "edge_levels",
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
