"""Executors: what the engine core launches steps through, found by name in
ember.registry.ExecutorRegistry (built in: "uni", one worker in this process)."""
