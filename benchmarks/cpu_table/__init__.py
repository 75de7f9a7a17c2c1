"""The Transformer's CPU table (``scripts/bench_cpu.py``): every engine and precision against eager
fp32 in one run, with hand-built peers, tk's call overhead and the issue's goals as ratios."""
