"""Serving and scale-out: ``tk serve`` (Ray Serve, KServe v2 over HTTP), ``tk infer --ray`` (Ray
Data) and ``tk deploy triton`` (a Triton model repository).

Ray and tritonclient are optional (``pip install 'tk[serve]'``): they are imported inside the
functions that need them, so ``import tk.serve`` and the KServe v2 protocol code stay light.
"""
