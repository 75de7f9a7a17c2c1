"""Serving and scale-out: ``tk serve`` (Ray Serve, KServe v2 over HTTP), ``tk infer --ray`` (Ray
Data) and ``tk deploy triton`` (a Triton model repository).

``tk serve`` is split by job: ``config`` (what runs, checked before Ray starts), ``model_server``
(one replica's requests -> batcher -> engine -> replies, without Ray), ``deployment`` (that server
in Ray Serve) and ``lifecycle`` (start, stop, signals); ``load/`` holds what drives a server from
outside (``--tune`` and the load tools).

Ray and tritonclient are optional (``pip install 'tk[serve]'``): they are imported inside the
functions that need them, so ``import tk.serve`` and the KServe v2 protocol code stay light.
"""
