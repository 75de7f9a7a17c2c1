"""What uses both sides of an artifact: export then check it, check engines, pick the fastest,
benchmark, run over files. The command line calls one function of here (or of a lower layer)
per command, and so can any Python user."""
