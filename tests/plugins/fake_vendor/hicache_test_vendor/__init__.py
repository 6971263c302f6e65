"""hicache-test-vendor: a vendor io_backend added without touching the core."""
