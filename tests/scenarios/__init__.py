"""The scenario corpus: small, real, seeded CPU trainings that really produce one anomaly each (or none),
instrumented with the SDK like a user's job, and the event streams they recorded (``streams/``)."""
