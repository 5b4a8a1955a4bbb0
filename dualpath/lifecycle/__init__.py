"""A request's lifecycle, as pure code both executors share: today its record (record.py);
the steps themselves are still written in testbed/cluster/conductor.py and simulator/cluster.py."""
