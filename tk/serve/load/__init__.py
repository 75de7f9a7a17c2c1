"""Load against ``tk serve``, and what is measured with it: ``tune`` (``tk serve --tune``), ``clients``
(concurrent ``tritonclient.http`` clients that count lost, duplicated and failed replies),
``scenarios`` and ``report`` (``scripts/load_test.py``'s scenarios, goals and table) and
``perf_analyzer`` (Triton's own load generator, run and read).

These drive a running server from outside, as its clients do; nothing here is imported by the
server itself.
"""
