"""Stage 3: the parameters sharded too, each unit gathered only around its forward and backward; modules built on the
meta device and materialised shard by shard.

With nothing offloaded the package's engine gathers the units (:mod:`.engine`, :mod:`.units`); offloaded, torch's
``fully_shard`` does, with its offload policy (:mod:`.sharded_module`). What a step obeys either way is in
:mod:`.step`.
"""
