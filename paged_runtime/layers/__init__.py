"""The model's building blocks, each owning its weights and how they load (a model file composes them).

``ops`` is the arithmetic under them (plain PyTorch or the compiled CPU kernels, chosen once by
``select_ops``); ``linear`` holds the pluggable ``LinearMethod`` and the shard specs for tensor
parallelism; ``attention`` is one module over whichever backend the runner built the step's metadata for.
"""
