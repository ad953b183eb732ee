"""The measurements: latency, throughput and serving benchmarks, prefix caching and speculative
decoding workloads, HF and compiled baselines side by side, the layer-by-layer comparison
with HF, and the capstone's checks.
"""
