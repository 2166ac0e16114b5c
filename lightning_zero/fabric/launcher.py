"""The launcher for ``start_method="popen"`` (copies of the script): Lightning's, except that rank 0 ends after the
ranks it started, and fails when one of them did."""

from __future__ import annotations

from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from lightning_zero._transport import launched


class ScriptLauncher(launched.RecordsStartedRanks, _SubprocessScriptLauncher):
    """Lightning's, except that this process, rank 0, ends after the ranks it started, and not with 0 when one of them
    failed (:mod:`lightning_zero._transport.launched`)."""
