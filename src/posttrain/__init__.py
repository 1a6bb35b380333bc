"""posttrain: preference and reinforcement-learning post-training for causal LMs.

The package root stays light: import ``posttrain.core`` for the pure algorithm layer.
"""

__version__ = "0.1.0"
