"""hicache-kv-split: the page_first_kv_split layout and its Triton kernel strategy."""
