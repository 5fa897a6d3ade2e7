"""ff: post-training of flow-matching generative models on Lightning."""

__version__ = "0.1.0"
