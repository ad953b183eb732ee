"""nanoserve: a small, real LLM inference server for Llama-3.2-1B, built one week at a time."""

__version__ = "0.1.0"
