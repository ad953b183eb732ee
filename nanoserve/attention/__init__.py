"""The attention layer: where K/V live and how a query finds them. The interface and the plain
prefill context (week 2), the naive cache (week 3), the paged cache and its PyTorch reference
(weeks 4-5), the Triton backend (week 6), and the choice between backends.
"""
