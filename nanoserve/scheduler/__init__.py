"""The scheduler layer: who runs each step. Sequences and batches, the block allocator, prefix
caching, the policies and preemption, and a simulator. Weeks 4, 7-9, 14, 15. No torch here.
"""
