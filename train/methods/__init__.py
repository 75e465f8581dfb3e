"""Training methods: each supplies ``loss(batch) -> (loss, metrics)`` to the one training loop.

Registry keyed by the recipe's ``method`` string.
"""

from .eagle3 import Eagle3Method

METHODS = {"eagle3": Eagle3Method}

__all__ = ["METHODS", "Eagle3Method"]
