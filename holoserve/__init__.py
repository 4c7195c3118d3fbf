"""HoloServe: 2:4 sparse INT8 BERT classifiers, compressed, exported and served."""

__version__ = "0.1.0"


class HoloServeError(Exception):
    """An error with a message meant for the user: what went wrong and what to do."""
