"""The emulated fabric: namespaces, links, tc shaping, DSCP marking, counters, containers, cleanup."""
