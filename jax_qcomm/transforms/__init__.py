"""The optax transformations: `sync` (every step), `diloco` (every H steps), accumulation,
clipping, their shared parts (keys, error feedback, the finite guard), where each part of a state
lives (:mod:`.specs`) and `describe`.

Above the collectives, below the runners.
"""
