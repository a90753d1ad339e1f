"""Tests of the KV transfer layer (transfer/)."""
