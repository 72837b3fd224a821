"""Executors: what continues a claimed run. The protocol and its run context, the agent loop, the model
protocol with a scripted model, and tools."""
