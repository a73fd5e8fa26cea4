"""Which strategy a job trains with: the spec's choice, or for auto the plan's verdict on a GPU."""
import copy

import pytest

from kubetune_api.manifest import parse_manifest
from kubetune_api.strategy import resolve_strategy
from kubetune_trainer.training.parallel import shard_units


def spec_of(example_manifest, **changes):
    manifest = copy.deepcopy(example_manifest)
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        node = manifest["spec"]
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return parse_manifest(manifest).spec


@pytest.mark.parametrize("changes,world,on_gpu,fits,expected", [
    ({"distributed__strategy": "fsdp"}, 4, True, True, "fsdp"),
    ({"distributed__strategy": "fsdp"}, 1, True, False, "ddp"),   # explicit, but one process: unsharded
    ({"distributed__strategy": "fsdp"}, 2, False, True, "fsdp"),  # explicit on the CPU: shards over gloo
    ({"distributed__strategy": "ddp"}, 4, True, False, "ddp"),
    ({}, 4, True, True, "ddp"),                      # auto: fits under ddp
    ({}, 4, True, False, "fsdp"),                    # auto: does not fit whole on one GPU
    ({}, 1, True, False, "ddp"),                     # one process has nothing to shard over
    ({}, 4, False, False, "ddp"),                    # CPU processes: memory is what the pod requests
    ({"model__quantization": "nf4"}, 4, True, False, "ddp"),  # a quantized base cannot be sharded
    ({"training__optimizer": "adamw8bit"}, 4, True, False, "ddp"),
])
def test_auto_shards_only_what_does_not_fit_and_can_be_sharded(example_manifest, changes, world, on_gpu, fits,
                                                               expected):
    assert resolve_strategy(spec_of(example_manifest, **changes), world, on_gpu, lambda: fits) == expected


def test_blocks_are_sharded_innermost_first():
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()

    class Inner(torch.nn.Linear):
        def __init__(self):
            super().__init__(2, 2)

    class Model(torch.nn.Module):
        _no_split_modules = ["Block", "Inner"]

        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block(), Block()])

    model = Model()
    units = shard_units(model)
    assert [type(u).__name__ for u in units] == ["Inner", "Block", "Inner", "Block"]
    assert units.index(model.blocks[0].inner) < units.index(model.blocks[0]), "an outer block after its inner ones"
