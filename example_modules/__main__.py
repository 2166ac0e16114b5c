"""LightningCLI entry point: ``python -m example_modules fit --config example_modules/configs/zero2.yaml``.

Model and data are chosen by ``class_path`` in the config (subclass mode), so one entry point serves the GPT
(``example_modules.gpt``) and the CNN (``example_modules.vision``).
"""

from __future__ import annotations

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override

import lightning_zero  # noqa: F401  (registers "zero1" and "zero2" before the Trainer resolves `strategy`)
from example_modules.report import LossReport


class ExampleCLI(LightningCLI):
    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # Always on, configurable as `loss_report.window`.
        parser.add_lightning_class_args(LossReport, "loss_report")


def main() -> None:
    ExampleCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True)


if __name__ == "__main__":
    main()
