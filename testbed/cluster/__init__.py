"""The node processes of a run and the conductor that drives requests through them."""
