"""Applications on top of the engine: the ``rlpost`` CLI, ``sample``/``export``, reports and progress bars."""
