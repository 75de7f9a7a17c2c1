"""The coverage suite: common architectures tk's other tests never saw, each exported to every CPU format and
checked, written as a table of architecture x format (docs/coverage.md). ``catalog`` lists the architectures,
``cells`` exports one and reads its verdicts, ``table`` writes and parses the table, ``report`` regenerates the
page outside pytest (``python -m tests.model_coverage.report``)."""
