"""The cluster harness (issue "scale-out"): Intermission on a RabbitMQ cluster and a replicated PostgreSQL,
simulated on one machine. So far it boots and removes the servers (``servers.py``); the workload, the
faults and the checks are still to come."""
