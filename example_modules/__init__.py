"""Example LightningModules and synthetic data for trying the ZeRO strategies, run through LightningCLI.

``python -m example_modules fit --config example_modules/configs/zero2.yaml`` trains a small GPT under
``strategy: zero2`` on 2 CPU processes; the other configs pick stage 1, the strategy class, or the CNN.
``python -m example_modules.fabric_gpt --strategy zero3 --devices 2`` trains the same GPT in a hand-written Fabric loop.
"""
