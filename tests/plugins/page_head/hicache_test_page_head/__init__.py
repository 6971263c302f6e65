"""hicache-test-page-head: a third-party layout that needs no core change."""
