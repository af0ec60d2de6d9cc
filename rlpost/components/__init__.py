"""Components shared by several algorithms, registered by the core (``rlpost.components.builtin``)."""
