"""Components shared by several algorithms, registered by the core (``rlpost.builtin``)."""
