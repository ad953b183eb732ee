"""The runner layer: one rank's device side. A Batch becomes a StepInput, then logits; CUDA
graphs replay the steps that fit them. Also the unbatched loops of weeks 2-3.
"""
