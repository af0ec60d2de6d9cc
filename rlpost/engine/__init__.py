"""The training engine: the runner and what it drives (work split, backends, checkpoints, run directory, guards, EMA,
metric sinks, held-out evaluation, recipe validation). Imports core, ops, components and models, never the apps."""
