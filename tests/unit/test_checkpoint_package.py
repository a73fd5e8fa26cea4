"""kubetune_trainer.checkpoint: one package where a checkpoint is written, listed and resumed, whose
imports run one way (down to kubetune_api, kubetune_trainer.storage and errors, never up to the loop or
the run), and whose listing side stays torch-free for the CLI."""
from __future__ import annotations

import ast
import subprocess
import sys

from tests.conftest import REPO

TRAINER = REPO / "trainer_image" / "src" / "kubetune_trainer"
# What the checkpoint package may import from the trainer: the storage layer below it, the errors, itself.
ALLOWED_BELOW = ("kubetune_trainer.storage", "kubetune_trainer.errors", "kubetune_trainer.checkpoint")


def trainer_imports(source) -> set[str]:
    """Every kubetune_trainer module a file imports (at any depth: module-level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kubetune_trainer"):
            found |= {node.module} if node.module != "kubetune_trainer" else {f"kubetune_trainer.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("kubetune_trainer")}
    return found


def test_the_checkpoint_package_imports_only_what_lies_below_it():
    upward = {f"{path.name}: {module}" for path in (TRAINER / "checkpoint").glob("*.py")
              for module in trainer_imports(path)
              if not any(module == allowed or module.startswith(allowed + ".") for allowed in ALLOWED_BELOW)}
    assert not upward, f"imports running upward out of kubetune_trainer.checkpoint: {sorted(upward)}"


def test_the_storage_layer_does_not_import_the_checkpoint_package():
    upward = {f"{path.name}: {module}" for path in (TRAINER / "storage").glob("*.py")
              for module in trainer_imports(path) if module.startswith("kubetune_trainer.checkpoint")}
    assert not upward, f"kubetune_trainer.storage importing upward: {sorted(upward)}"


def test_the_old_checkpoint_modules_are_gone():
    old = ["checkpoints.py", "checkpointing.py", "training_state.py", "run_directory.py",
           "storage/checkpoint_store.py", "storage/runs.py", "storage/catalog.py"]
    assert not [name for name in old if (TRAINER / name).exists()]


def test_what_the_cli_imports_to_list_runs_and_checkpoints_is_torch_free():
    code = ("import sys; import kubetune_trainer.checkpoint.catalog, kubetune_trainer.checkpoint.store, "
            "kubetune_trainer.checkpoint.resume, kubetune_trainer.checkpoint.runs, kubetune_trainer.checkpoint.files; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
