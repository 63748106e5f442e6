"""KV beyond the device pool: swapping preempted streams to host memory, and the host tier's copies into the pool."""
