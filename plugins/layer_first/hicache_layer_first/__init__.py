"""hicache-layer-first: the layer_first layout and its Triton kernel strategy."""
