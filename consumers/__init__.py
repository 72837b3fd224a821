"""RabbitMQ consumers of the six command queues, all through one ack policy."""
