"""How tk measures: timed calls interleaved across engines, the load guard, the matrix-product rates at a
model's shapes (roofline), the machine's description, and the one JSON envelope of a benchmark run. Below the
workflows (tk bench, tk optimize, tk serve --tune) and the benchmark scenarios (benchmarks/), which share it."""
