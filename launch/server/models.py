"""What a request's ``model`` names: the base model or one of the LoRA adapters the engine
serves; the ``/v1/models`` cards of them all; loading and unloading adapters at run time."""

import asyncio
import time

from strata.engine_core.protocol import LoRAAdapter
from strata.launch.async_engine import AsyncEngine
from strata.launch.server.protocol import APIError, LoadLoRAAdapterRequest, ModelCard, UnloadLoRAAdapterRequest


def served_adapter(engine: AsyncEngine, base_name: str, model: str) -> LoRAAdapter | None:
    """The adapter ``model`` names (None: the base model, ``base_name``); 404 if it names neither."""
    if model == base_name:
        return None
    adapter = engine.loras.get(model)
    if adapter is None:
        raise APIError.model_not_found(model)
    return adapter


class ServedModels:
    """The model cards, and the adapter endpoints (404 unless the engine takes runtime updates)."""

    def __init__(self, engine: AsyncEngine, base_name: str) -> None:
        self.engine = engine
        self.base_name = base_name
        self.created = int(time.time())

    def cards(self) -> list[ModelCard]:
        """The base model, then every adapter with the base as its ``parent``."""
        return [self.card(name) for name in [self.base_name, *self.engine.loras.adapters]]

    def card(self, model: str) -> ModelCard:
        adapter = served_adapter(self.engine, self.base_name, model)
        if adapter is None:
            return ModelCard(id=model, created=self.created, max_model_len=self.engine.max_model_len)
        return ModelCard(
            id=model, created=self.created, max_model_len=self.engine.max_model_len, root=adapter.path,
            parent=self.base_name,
        )

    async def load(self, body: LoadLoRAAdapterRequest) -> str:
        """Serve a new adapter once it is checked against the base model; 400 with the reason
        if it cannot be (a name already in use, missing files, a rank or shapes that do not fit)."""
        self._require_runtime_updates()
        if body.lora_name == self.base_name:
            raise APIError(400, f"{body.lora_name!r} is the base model's name", param="lora_name")
        try:  # reads the adapter's config and weights header: off the event loop
            await asyncio.to_thread(self.engine.loras.load, body.lora_name, body.lora_path)
        except ValueError as error:
            raise APIError(400, str(error), param="lora_path") from None
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    def unload(self, body: UnloadLoRAAdapterRequest) -> str:
        """Stop serving an adapter: new requests naming it get 404, running ones finish."""
        self._require_runtime_updates()
        try:
            self.engine.loras.unload(body.lora_name)
        except KeyError:
            raise APIError(
                404, f"no LoRA adapter named {body.lora_name!r} is loaded", param="lora_name", code="lora_not_found"
            ) from None
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    def _require_runtime_updates(self) -> None:
        if not self.engine.args.enable_lora_runtime_updates:
            raise APIError(
                404, "loading and unloading LoRA adapters at run time is off: start the server with "
                "--enable-lora-runtime-updates", code="runtime_lora_updates_off",
            )
