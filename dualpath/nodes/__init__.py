"""The node processes: host agents, engines and their services, group leaders, read queues."""
