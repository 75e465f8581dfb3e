"""Training methods: each is an ``nn.Module`` whose ``forward(batch)`` returns
``(loss, metrics)`` for the one training loop; registry keyed by the recipe's ``method``."""

from .draft import DraftKDMethod
from .eagle1 import Eagle1Method
from .eagle3 import Eagle3Method
from .medusa import MedusaMethod
from .medusa2 import Medusa2Method

METHODS = {"eagle3": Eagle3Method, "eagle": Eagle1Method, "medusa1": MedusaMethod, "medusa2": Medusa2Method, "draft": DraftKDMethod}

__all__ = ["METHODS", "DraftKDMethod", "Eagle1Method", "Eagle3Method", "MedusaMethod", "Medusa2Method"]
