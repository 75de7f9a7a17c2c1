"""What a format's writer (``tk.export``) and its engine (``tk.runtime``) both need to know.

File names, how a saved program is loaded, which machine a compiled file can run on. Both sides
import from here; neither imports the other.
"""
