"""Integrations of hicache with inference engines (each imported only on demand)."""
