"""Tiered storage for inactive conversations' KV: tier interface, tiers, serialization, tier manager."""
