"""Stage 3: parameters sharded by torch's ``fully_shard``, each unit gathered only around its forward and backward;
modules built on the meta device and materialised shard by shard."""
