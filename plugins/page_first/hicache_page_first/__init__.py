"""hicache-page-first: page_first and page_first_direct layouts and their Triton kernel strategies."""
