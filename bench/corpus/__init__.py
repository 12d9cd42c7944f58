"""The corpus of varied trainings: seeded CPU runs the detectors are judged on (see README.md here)."""
