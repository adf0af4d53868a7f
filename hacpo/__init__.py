"""hacpo: heterogeneous agent collaborative policy optimization (arXiv 2603.02604)."""
__version__ = "0.1.0"   # the one place it is set: setup.py reads it, `hacpo --version` prints it
