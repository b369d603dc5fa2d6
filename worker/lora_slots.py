"""This rank's side of the LoRA slot pool: putting the adapters a step asks for into their slots.

An adapter is read from its PEFT directory once (only this rank's shard of each tensor, checked
against the model), laid out as a slot holds it (``lora.SlotWeights``: padded to the pool's
rank, scale folded in) and kept in a CPU-memory LRU cache of ``max_cpu_loras`` adapters, so
swapping a cached adapter into a slot is two copies per linear.
"""

from collections import OrderedDict
from dataclasses import dataclass, field

from safetensors import SafetensorError, safe_open

from strata.engine_core.protocol import LoRAAdapter, LoRASlotLoad
from strata.worker.lora import LoRAStep, LoRATarget, SlotWeights
from strata.worker.lora_files import AdapterFiles, check_adapter, read_adapter
from strata.worker.model_config import ModelConfig


@dataclass
class LoRASlots:
    """The pools of this rank's ``targets``, the ``step`` layout they read, and the cache of
    adapters to fill them from."""

    targets: list[LoRATarget]
    step: LoRAStep
    model_config: ModelConfig
    max_rank: int
    max_cached: int
    cached: "OrderedDict[int, list[SlotWeights]]" = field(default_factory=OrderedDict)  # by lora_id, oldest first

    def load(self, loads: list[LoRASlotLoad]) -> dict[int, str]:
        """Put each adapter into its slot (before the step that uses it runs). Returns those
        that could not be read, by ``lora_id``, with the reason: the scheduler fails their
        requests (whatever their rows compute meanwhile is dropped) and never reuses the load."""
        errors = {}
        for load in loads:
            try:
                weights = self._weights(load.adapter)
            except ValueError as error:
                errors[load.adapter.lora_id] = f"LoRA adapter {load.adapter.name!r} could not be loaded: {error}"
                continue
            for target, target_weights in zip(self.targets, weights, strict=True):
                target.pool.load(load.slot, target_weights)
        return errors

    def _weights(self, adapter: LoRAAdapter) -> list[SlotWeights]:
        """The adapter laid out for each target: from the cache, else read (evicting the least
        recently used adapter beyond ``max_cached``)."""
        weights = self.cached.pop(adapter.lora_id, None)
        if weights is None:
            weights = self._read(adapter)
        self.cached[adapter.lora_id] = weights
        while len(self.cached) > self.max_cached:
            self.cached.popitem(last=False)
        return weights

    def _read(self, adapter: LoRAAdapter) -> list[SlotWeights]:
        """Read this rank's shards of the adapter's tensors; ValueError, naming the adapter, if it
        does not fit the model or the pool."""
        files = read_adapter(adapter.path)
        check_adapter(files, self.model_config, self.max_rank)
        try:
            return self._read_shards(files)
        except (OSError, SafetensorError) as error:  # the files changed since they were checked
            raise ValueError(f"{str(files.weights_file)!r} is not readable ({error})") from None

    def _read_shards(self, files: AdapterFiles) -> list[SlotWeights]:
        weights = []
        with safe_open(files.weights_file, framework="pt", device="cpu") as handle:
            for target in self.targets:
                pool = target.pool
                parts = []
                for module, rows in zip(target.modules, pool.b_rows):
                    names = files.weights.get((target.layer, module))
                    if names is None:
                        parts.append(None)
                        continue
                    a_name, b_name = names
                    parts.append((handle.get_slice(a_name)[:, pool.a_columns], handle.get_slice(b_name)[rows]))
                weights.append(pool.slot_weights(parts, files.scale))
        return weights
