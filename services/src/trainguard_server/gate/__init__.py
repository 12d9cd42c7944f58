"""``trainguard gate``: block a canary release whose anomaly profile is worse than a baseline's.

Pure logic (no I/O): ``stats`` (robust statistics for 2-5 runs), ``policy`` (every threshold, its default
and meaning), ``profile`` (a baseline's runs summarised), ``compare`` (checks and the verdict), ``report``
(markdown with a plot, JUnit XML). I/O: ``fetch`` (read the stores), ``baselines`` (persist named
baselines), ``service`` (define / gate over the stores), ``client`` (the API over HTTP), ``cli``.
"""
