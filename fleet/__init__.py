"""The worker runtime: the worker process, runs under leases, lease keeping, the reclaim sweep, and the
worker's metrics and health endpoint."""
