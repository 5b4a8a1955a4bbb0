"""Driving the simulator from a topology, and validating it against testbed runs."""
