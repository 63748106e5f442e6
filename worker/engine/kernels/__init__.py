"""The kernels: the C++ CPU kernels (each source beside its header), their build and binding, the CPU linears and attention built on them, and the Triton attention kernels."""
