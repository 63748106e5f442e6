"""Tensor parallelism: the rank group, the weights' sharding, and the steps rank 0 sends its ranks."""
