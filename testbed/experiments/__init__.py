"""Experiments on a live cluster: the ablation modes end to end, and isolation."""
