"""A simulated worker: the real engine's scheduler, block manager and Redis protocol, with the
model's forward pass replaced by a cost model that says how many seconds each step takes."""
