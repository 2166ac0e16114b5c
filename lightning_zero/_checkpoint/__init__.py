"""Sharded checkpoint directories: what goes in and comes out for the live module and optimizers of any stage, and
the directory format itself (written by every rank, published atomically, read at any world size)."""
