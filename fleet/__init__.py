"""The worker runtime: the worker process, runs under leases, lease keeping and the reclaim sweep."""
