"""The ZeRO core that both front ends drive: one mode per way of training a module (see :mod:`.mode`)."""
