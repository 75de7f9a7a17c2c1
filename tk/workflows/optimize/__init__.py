"""``tk optimize``: a workflow over export, check and bench (see ``tk.workflows.optimize.run``)."""

from tk.workflows.optimize.run import OptimizeOptions, OptimizeResult, optimize, ranges_for_sizes, timing_sizes

__all__ = ["OptimizeOptions", "OptimizeResult", "optimize", "ranges_for_sizes", "timing_sizes"]
