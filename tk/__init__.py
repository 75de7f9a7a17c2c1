"""tk: turn a PyTorch model into a static graph, prove it computes what PyTorch computes, make it fast.

``import tk`` stays light: the heavy pieces load from ``tk.models``, ``tk.export`` and
``tk.runtime`` when they are used.
"""

__version__ = "0.1.0"
