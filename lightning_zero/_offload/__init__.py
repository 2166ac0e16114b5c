"""Offload: the optimizer's side of training kept in host memory, or its state on disk, when device memory is short.

The decision lives in one object, the *placement* (:mod:`.placement`), chosen once per strategy from the options
beside the mode; the engine, ``ShardedModule`` and the modes ask it, and nothing outside this package and the option
parsing looks at the offload target. The other modules are its means: host allocations (:mod:`.host`), disk files
(:mod:`.disk`), stage 3's parameter and gradient shards in files (:mod:`.param_files`) and the optimizer stepped one
unit at a time over them (:mod:`.by_unit`), kernel choice (:mod:`.kernels`) and the process group
(:mod:`.process_group`).

Vocabulary:

- **host**: CPU memory. With a CUDA module it is pinned (page-locked), so copies to and from the device run
  asynchronously at full bus speed.
- **master**: the optimizer's copy of this rank's shard of a parameter (see :class:`ShardedParam`). Offloaded, the
  masters, a host copy of each reduced gradient shard and the optimizer state live on the host, and the optimizer
  steps there; only the updated shard travels back to the device.
- **disk state**: optimizer state tensors backed by memory-mapped files in the offload directory. Each file's space
  is reserved when it is created, so a full disk fails there, with an error naming the directory, and never in a
  later write-back; after every step the pages are dropped from the process, so resident memory holds the state
  only while a step touches it. The files have no names (see :mod:`lightning_zero._files`): the kernel frees them
  when the process ends, however it ends, so even a killed run leaves nothing in the directory.
- **parameter files** (ZeRO-Infinity): stage 3's parameter shards and their gradients in such files too, one pair per
  unit, read ahead of each unit's gather and dropped from the process after it.
"""
