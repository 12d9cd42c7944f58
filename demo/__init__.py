"""`make demo`: real small torch trainings instrumented with the SDK, and what it captured of each."""
