"""Real model code under every stage: Hugging Face ``transformers`` models (GPT-2 with its tied embeddings and
``Conv1D`` layers, Llama, T5) and a peft LoRA adapter, built where Lightning tells users to build large models
(``configure_model``, ``Trainer.init_module()``, ``fabric.init_module()``) from a config, by ``from_pretrained`` of
a folder made here with ``save_pretrained``, or LitGPT-style with ``model.apply(init_fn)``; nothing is downloaded.

The weights after set-up are ``"ddp"``'s bit for bit (stage 3 builds them without memory and replays what the user's
code did, see lightning_zero/_stage3/lazy.py); the losses and final weights of three AdamW steps are ``"ddp"``'s within
the fp32 tolerance of tests/oracle.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.launch import launch, write_payload
from tests.oracle import FP32, close
from tests.scenarios import read_results
from tests.workers.hf_models import Case, save_pretrained

pytestmark = pytest.mark.slow  # launches processes

ALL_STAGES = ("ddp", "zero1", "zero2", "zero3")
CASES = [
    Case("gpt2_configure_model", "trainer", "gpt2", strategies=ALL_STAGES, saved=True),
    Case("llama_configure_model", "trainer", "llama"),
    Case("t5_configure_model", "trainer", "t5"),
    Case("gpt2_from_pretrained", "trainer", "gpt2", "pretrained", strategies=ALL_STAGES),
    Case("llama_apply_init", "trainer", "llama", "apply_init"),
    Case("gpt2_lora", "trainer", "gpt2", "lora", strategies=("ddp", "zero2", "zero3")),
    Case("gpt2_frozen_embeddings", "trainer", "gpt2", "frozen_embeddings"),
    Case("llama_trainer_init_module", "trainer_init_module", "llama", "pretrained"),
    Case("gpt2_init_module", "fabric", "gpt2"),
    Case("llama_from_pretrained_init_module", "fabric", "llama", "pretrained"),
    Case("llama_empty_init_then_apply", "fabric", "llama", "apply_init"),
]
RUNS = [(case.name, strategy) for case in CASES for strategy in case.strategies if strategy != "ddp"]


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf")


@pytest.fixture(scope="module")
def results(out_dir: Path) -> list[dict[Any, Any]]:
    out = out_dir
    pretrained = out / "pretrained"
    for kind in ("gpt2", "llama"):
        save_pretrained(kind, pretrained / kind)
    write_payload(out, cases=CASES, pretrained=pretrained)
    launch("tests.workers.hf_models", [str(out)], 2)
    return read_results(out, 2)


@pytest.mark.parametrize(("case", "strategy"), RUNS, ids=[f"{c}-{s}" for c, s in RUNS])
def test_weights_after_set_up_are_ddps_exactly(results: list[dict[Any, Any]], case: str, strategy: str) -> None:
    for rank, per_rank in enumerate(results):
        ours, ddp = per_rank[(case, strategy)]["initial"], per_rank[(case, "ddp")]["initial"]
        assert ours.keys() == ddp.keys()
        for key, expected in ddp.items():
            assert torch.equal(ours[key], expected), f"rank {rank} {case} {strategy} {key}"


@pytest.mark.parametrize(("case", "strategy"), RUNS, ids=[f"{c}-{s}" for c, s in RUNS])
def test_training_continues_as_ddp(results: list[dict[Any, Any]], case: str, strategy: str) -> None:
    for rank, per_rank in enumerate(results):
        ours, ddp = per_rank[(case, strategy)], per_rank[(case, "ddp")]
        what = f"rank {rank} {case} {strategy}"
        assert len(ours["losses"]) == len(ddp["losses"]) == 3
        close(torch.tensor(ours["losses"]), torch.tensor(ddp["losses"]), f"{what} losses", FP32)
        for key, expected in ddp["final"].items():
            close(ours["final"][key], expected, f"{what} {key}", FP32)


def test_pretrained_weights_are_the_folders(results: list[dict[Any, Any]], tmp_path: Path) -> None:
    """``from_pretrained`` inside the context loads the folder's tensors (a lost load would leave initial values)."""
    from transformers import GPT2LMHeadModel

    save_pretrained("gpt2", tmp_path)
    expected = GPT2LMHeadModel.from_pretrained(tmp_path).state_dict()
    for per_rank in results:
        loaded = per_rank[("gpt2_from_pretrained", "zero3")]["initial"]
        for key, value in expected.items():
            assert torch.equal(loaded[key], value), key


def test_zero3_checkpoint_to_a_save_pretrained_folder(results: list[dict[Any, Any]], out_dir: Path) -> None:
    """A zero3 checkpoint directory, through :func:`whole_state_dict`, into the model's own ``save_pretrained``: the
    folder ``from_pretrained`` reads gives the logits of the model ``"ddp"`` trained (from its checkpoint file)."""
    from transformers import GPT2LMHeadModel

    from lightning_zero import whole_state_dict
    from tests.workers.hf_models import config

    models = {}
    for strategy in ("ddp", "zero3"):
        model = GPT2LMHeadModel(config("gpt2"))
        model.load_state_dict(whole_state_dict(out_dir / f"gpt2_configure_model-{strategy}.ckpt", prefix="model."))
        model.save_pretrained(out_dir / f"gpt2-{strategy}")
        models[strategy] = GPT2LMHeadModel.from_pretrained(out_dir / f"gpt2-{strategy}").eval()
    assert (out_dir / "gpt2_configure_model-zero3.ckpt").is_dir()
    tokens = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        close(models["zero3"](tokens).logits, models["ddp"](tokens).logits, "logits", FP32)
    for key, value in results[0][("gpt2_configure_model", "zero3")]["final"].items():
        assert torch.equal(models["zero3"].state_dict()[key], value), key
