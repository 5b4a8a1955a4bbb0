"""KV: the block layouts, where a request's KV lives and moves, its plan, and the engines' connectors."""
