"""The RL loop, driver side: the step loop, its batch sources, the step batch, and the trainer-side
micro-batching and schedule the actor runs (leaf modules: this package imports nothing itself)."""
