"""The helpers' release, ``attention_lab.__version__``: numbers only (X.Y.Z), written here once.

``pyproject.toml`` reads it from here, and `make release` writes it into every notebook's setup cell,
which reinstalls helpers older than its notebook's (a Colab runtime keeps what it installed): raise it
when the helpers change after students have installed them.
"""

__version__ = "0.1.0"
