"""hicache-example: a layout, a Triton kernel for it and a vendor io_backend, outside the hicache tree."""
