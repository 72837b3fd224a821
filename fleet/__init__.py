"""The worker process: settings, run execution under a lease, reclaim sweep, CLI."""
