"""The engine: the one owner of a run's life.

Every transition a run goes through (claims of every kind, start, progress save, pause, end, cancel,
ending, expiry, reply admission and start, closure, deadline move, outbox retry) is applied here and only
here: consumers, the fleet, the executors, the sweeper, the command line and the console ask the engine,
never the store's transition functions directly. ``store/`` keeps the database (pool, named statements,
migrations, row decoding) and the read models; the engine decides what a command does, runs it through the
one committer, and hands the events its commit caused to the one event sink.
"""
