"""Optimizers for sharded modules: flat optimizers that step each group's shard in one pass
(:mod:`fsdp.optim.flat`), Muon on whole owned matrices (:mod:`fsdp.optim.muon`), and the
``torch.optim`` step hooks that keep any optimizer's updates visible (:mod:`fsdp.optim.step_hooks`)."""

from fsdp.optim.flat import FlatAdam, FlatAdamW, FlatOptimizer, FlatSGD, flat_optimizer
from fsdp.optim.muon import Muon

__all__ = ["FlatAdam", "FlatAdamW", "FlatOptimizer", "FlatSGD", "Muon", "flat_optimizer"]
