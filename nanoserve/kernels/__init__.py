"""Triton kernels: paged attention (week 6), the fused kernels of the decode path (week 12),
the greedy argmax. Each is tested on the CPU through Triton's interpreter."""
