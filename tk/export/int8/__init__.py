"""int8 for every writer that quantizes: the calibration and judged batches (``calibration``), and the one
search for the layers that leave int8 (``evaluator``: reference outputs and SQNR; ``search``: the ranker and
the rounds policy). Each int8 writer keeps a small adapter: what its units are and how to build its model
with some of them left out (``tk.export.aoti.int8``, ``tk.export.onnx.static_int8``, ``tk.export.openvino.writer``)."""
