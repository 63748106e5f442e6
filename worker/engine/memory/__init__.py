"""The KV memory: the device and dtype, the block pool and its layout, the block manager and prefix cache with the host tier's index."""
