"""``strategy="zero_auto"``: the stage and offload chosen from the model's size and the memory each rank can use.

Vocabulary:

- **candidate**: one placement the choice weighs (:class:`~.candidates.Candidate`), from ``zero1`` to ZeRO-Infinity,
  in the order of their traffic: the first that fits is the one chosen.
- **workload**: what the model state's bytes follow (parameters, precision, optimizer, ranks): :mod:`.choice`.
- **budget**: the bytes one rank may fill, measured at set-up (:mod:`.budget`), agreed by every rank.
- **activation reserve**: the part of the budget left for what the estimate does not count (activations, buffers,
  communication buckets, stage 3's gathered units, the framework's own allocations).
"""
