"""The LoRA adapters a frontend serves, by name, and the offline API's way to name one.

Every load is checked against the base model before any request can name it (a bad adapter
is refused with the reason, and the engine never sees it) and gets a fresh ``lora_id``, so KV
computed with an unloaded adapter's weights is never reused for another load under its name.
Adapters reach the EngineCore on the requests that use them; every data-parallel replica sees
the same ones.
"""

import itertools
from dataclasses import dataclass, field
from pathlib import Path

from strata.engine_core.protocol import LoRAAdapter
from strata.runtime.engine_args import EngineArgs, ResolvedConfig
from strata.worker.lora_files import check_adapter, read_adapter
from strata.worker.model_config import ModelConfig, read_model_config


@dataclass(frozen=True)
class LoRARequest:
    """Run a prompt with the LoRA adapter in the PEFT directory ``lora_path``, served as
    ``lora_name`` (``LLM.generate(..., lora_request=...)``). The first request naming an
    adapter loads it; later ones with the same name and path reuse it."""

    lora_name: str
    lora_path: str


@dataclass
class LoRARegistry:
    """Served adapters by name. ``enabled`` is False when the engine has no adapter slots:
    then every load is refused."""

    model_config: ModelConfig | None  # the base model's, to check adapters against
    max_lora_rank: int
    enabled: bool
    adapters: dict[str, LoRAAdapter] = field(default_factory=dict)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    @classmethod
    def start(cls, args: EngineArgs, resolved: ResolvedConfig) -> "LoRARegistry":
        """The registry with ``--lora-modules`` loaded; ValueError naming the first bad one."""
        enabled = args.lora_enabled
        config = read_model_config(resolved.model_path) if enabled else None
        registry = cls(config, args.max_lora_rank, enabled)
        for name, path in args.lora_module_paths().items():
            registry.load(name, path)
        return registry

    def load(self, name: str, path: str) -> LoRAAdapter:
        """Serve the adapter in ``path`` as ``name``; ValueError if LoRA is off, the name is
        taken or the adapter cannot run on the base model."""
        if not self.enabled:
            raise ValueError("LoRA adapters are off: start the engine with --enable-lora")
        if not name:
            raise ValueError("a LoRA adapter's name must not be empty")
        if name in self.adapters:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
        assert self.model_config is not None
        files = read_adapter(path)
        check_adapter(files, self.model_config, self.max_lora_rank)
        adapter = LoRAAdapter(name, next(self._ids), str(Path(path).resolve()))
        self.adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        """Stop serving ``name`` (requests already running finish with it); KeyError if unknown."""
        if name not in self.adapters:
            raise KeyError(f"no LoRA adapter named {name!r} is loaded")
        del self.adapters[name]

    def get(self, name: str) -> LoRAAdapter | None:
        return self.adapters.get(name)

    def for_request(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter an offline request names, loaded at its first use; ValueError if its
        name is served from another path."""
        adapter = self.adapters.get(request.lora_name)
        if adapter is None:
            return self.load(request.lora_name, request.lora_path)
        if adapter.path != str(Path(request.lora_path).resolve()):
            raise ValueError(
                f"LoRA adapter {request.lora_name!r} is served from {adapter.path}, not {request.lora_path}"
            )
        return adapter
