"""The model layer: the network and its weights. Config, layers, the Llama model, the loaders
(safetensors, GGUF and its quantized formats), the tiny bundled checkpoint, the sharded
(tensor-parallel) layers. Weeks 1, 2, 13 and 18. Imports nothing else of nanoserve.
"""
