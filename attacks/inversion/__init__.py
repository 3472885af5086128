"""Inversion attacks by a curious server: rebuild a client's images or labels from what it uploaded."""
