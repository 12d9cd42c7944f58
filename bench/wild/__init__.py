"""The wild-log corpus (``tests/fixtures/wild``): real failure logs users pasted in public issue threads,
their labels, the tune / held-out split, and how a verdict of the product is scored against a label.
``bench/logs.py`` runs the corpus through ``trainguard replay`` into ``trainguard serve``;
``tests/services/replay/test_wild_corpus.py`` judges it in process against recorded verdicts."""
