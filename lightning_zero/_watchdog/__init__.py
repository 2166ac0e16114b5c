"""The stall watchdog: on every transport (gloo across hosts, NCCL, the shared-memory channel), ranks that run different
code or a peer that stopped fail within ``stall_after`` seconds on every rank, with an error naming what each rank was
doing, instead of waiting the process group's timeout (30 minutes by default).

One job per module, each with its words at the top: :mod:`.watchdog` (the thread, and when it asks), :mod:`.rounds`
(the store protocol of a round), :mod:`.verdicts` (what the answers mean, and the words of the errors),
:mod:`.signals` (signals received while the main thread is blocked in native code), :mod:`.release` (making a blocked
collective fail) and :mod:`.ending` (ending a process whose main thread stays blocked). It sits above the transport it
watches: the collectives ask it through :mod:`lightning_zero._transport.stalls` and record what they do in
:mod:`lightning_zero._transport.activity`, never importing it.
"""
