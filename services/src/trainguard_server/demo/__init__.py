"""``trainguard demo``: the embedded server watching real small trainings go wrong."""
