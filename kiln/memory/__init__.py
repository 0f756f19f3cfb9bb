"""Memory: what a training step holds, measured and predicted, and the levers that shrink it.

    kiln.memory.estimate   bytes per component and per tensor kind, from the model code's own tensors
    kiln.memory.measure    saved-tensor bytes, live bytes, CUDA peaks and snapshots
    kiln.memory.levers     the `memory` config section applied to a built model
    kiln.memory.planner    search the levers for the fastest configuration that fits
"""
