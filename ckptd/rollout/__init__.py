"""The rollout side: following a run's weight versions, loading them verified, and reporting
what each rollout worker serves."""

from ckptd.rollout.subscriber import WeightSubscriber
from ckptd.rollout.weights import Weights

__all__ = ["WeightSubscriber", "Weights"]
