"""The plugin kernel: component interfaces (:mod:`~rlpost.core.api`), the data contract, hook specifications, typed
registries, the plugin host and the run context. Imports nothing else from rlpost (see docs/design.md, "Layers")."""
