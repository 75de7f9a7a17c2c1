"""The goals of issue 13 (``scripts/bench_goals.py``): int8 and bf16 Transformer artifacts against
eager fp32 and the measured matrix-product rates, and a Hugging Face BERT exported by tk against
Optimum's export of the same model."""
