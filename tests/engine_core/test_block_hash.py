"""Block hashes with LoRA adapters: an adapter keys every block of its requests, the base
model's hashes are those the engine always computed."""

from strata.engine_core.block_hash import extend_block_hashes
from strata.engine_core.protocol import LoRAAdapter

TOKENS = list(range(8))


def hashes_of(**keys) -> list[bytes]:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, TOKENS, 4, **keys)
    return hashes


def test_base_model_hashes_are_unchanged():
    # Digests from before adapters existed: caches and routers of older replicas still agree.
    assert [h.hex() for h in hashes_of()] == ["4e7663bea9922cfdf9bbe8306f4e221a", "123d40b523bc2fd9d39d8b176264ad10"]
    assert [h.hex() for h in hashes_of(salt="s")] == [
        "ef817dca14c58bf77d988cd4241405a2", "933f6bbb2dd97973628e56cbb8924a3b",
    ]


def test_an_adapter_changes_every_block_hash():
    base, adapted = hashes_of(), hashes_of(lora=LoRAAdapter("a", 1, "/a"))
    assert all(b != a for b, a in zip(base, adapted))


def test_adapters_differ_by_name_and_by_load():
    first = hashes_of(lora=LoRAAdapter("a", 1, "/a"))
    assert first == hashes_of(lora=LoRAAdapter("a", 1, "/elsewhere"))  # the path is not the key
    assert first != hashes_of(lora=LoRAAdapter("b", 1, "/a"))
    assert first != hashes_of(lora=LoRAAdapter("a", 2, "/a"))  # reloaded: its old KV is no hit


def test_adapter_and_salt_key_together():
    lora = LoRAAdapter("a", 1, "/a")
    assert hashes_of(lora=lora, salt="s") not in (hashes_of(lora=lora), hashes_of(salt="s"))
