"""KV codecs in the chunk store: what they cost in bytes and error, that every
tier reads the same values, and that damaged or foreign coded entries are
recomputed, never used."""

from __future__ import annotations

import json
import logging
import struct
import zlib

import diskcache
import pytest
import torch

from blend_integrations import BlendConfig
from blend_integrations.engines.base import engine_store
from blend_integrations.store import ChunkKV, ChunkStore, coded_key
from blend_integrations.store.codec import decode_kv, encode_kv, layer_bytes
from blend_integrations.store.format import encode, read_layout
from blend_integrations.store.layered import LayerReader
from tests.fixtures.entries import make_entry, same

CODECS = ["fp8", "int8"]


def keys_like(kv: torch.Tensor) -> torch.Tensor:
    """KV shaped like a real model's: keys with two outlier channels (pre-RoPE
    keys have them), values without."""
    kv = kv.clone()
    kv[:, 0, :, :, 3] *= 30
    kv[:, 0, :, :, 7] += 12
    return kv


def kv_of(layers=4, heads=3, tokens=64, head_dim=64, seed=0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return keys_like(torch.randn(layers, 2, heads, tokens, head_dim, generator=g)).to(dtype)


def coded_bytes(kv: torch.Tensor, codec: str | None) -> int:
    return len(encode(ChunkKV(coded_key("ab" * 32, codec), kv)))


@pytest.mark.parametrize(
    "shape",
    [(30, 3, 64, 64), (32, 8, 512, 128)],  # SmolLM2's layers, KV heads and head size; Llama-3-8B's
    ids=["smollm2", "llama3-8b"],
)
@pytest.mark.parametrize("codec", CODECS)
def test_coded_entries_take_at_most_03_of_float32_and_055_of_bfloat16(codec, shape):
    layers, heads, tokens, head_dim = shape
    kv = kv_of(layers, heads, tokens, head_dim)
    coded = coded_bytes(kv, codec)
    assert coded <= 0.3 * coded_bytes(kv, None)
    assert coded <= 0.55 * coded_bytes(kv.to(torch.bfloat16), None)
    assert coded == coded_bytes(kv.to(torch.bfloat16), codec)  # the codes do not depend on the KV dtype


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_int8_error_is_half_a_step_of_its_group():
    kv = kv_of()
    back = decode_kv(encode_kv(kv, "int8"), "int8", 3, 64, 64, torch.float32)
    k_step = kv[:, 0].abs().amax(dim=2, keepdim=True) / 127  # per channel
    v_step = kv[:, 1].abs().amax(dim=3, keepdim=True) / 127  # per token
    assert bool(((back[:, 0] - kv[:, 0]).abs() <= k_step / 2 + 1e-6).all())
    assert bool(((back[:, 1] - kv[:, 1]).abs() <= v_step / 2 + 1e-6).all())


def test_keys_scaled_per_channel_beat_one_scale_per_head():
    """Why keys get a scale per channel: with an outlier channel, one scale
    per head leaves the other channels a few codes each."""
    kv = kv_of()
    per_channel = decode_kv(encode_kv(kv, "int8"), "int8", 3, 64, 64, torch.float32)
    step = kv[:, 0].abs().amax(dim=(2, 3), keepdim=True) / 127
    per_head = (kv[:, 0] / step).round() * step
    assert relative_error(per_channel[:, 0], kv[:, 0]) < relative_error(per_head, kv[:, 0]) / 4


def test_fp8_keys_scaled_per_channel_keep_quiet_channels():
    """Why fp8 keys get a scale per channel too: under one scale per head, a
    channel far smaller than the head's largest falls below e4m3's normal
    range and loses its digits."""
    kv = kv_of()
    kv[:, 0, :, :, 10:] *= 1e-4
    back = decode_kv(encode_kv(kv, "fp8"), "fp8", 3, 64, 64, torch.float32)
    k = kv[:, 0]
    scale = k.abs().amax(dim=(2, 3), keepdim=True) / 448
    per_head = (k / scale).to(torch.float8_e4m3fn).float() * scale
    assert relative_error(back[:, 0, ..., 10:], k[..., 10:]) < 0.04
    assert relative_error(per_head[..., 10:], k[..., 10:]) > 0.5


@pytest.mark.parametrize("codec,bound", [("fp8", 0.04), ("int8", 0.01)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoded_values_are_close_in_the_kv_dtype(codec, bound, dtype):
    kv = kv_of(dtype=dtype)
    back = decode_kv(encode_kv(kv, codec), codec, 3, 64, 64, dtype)
    assert back.dtype == dtype and back.shape == kv.shape
    assert relative_error(back, kv) < bound


@pytest.mark.parametrize("codec", CODECS)
def test_zero_and_empty_chunks(codec):
    zero = torch.zeros(2, 2, 2, 5, 8)
    assert torch.equal(decode_kv(encode_kv(zero, codec), codec, 2, 5, 8, torch.float32), zero)
    empty = torch.zeros(2, 2, 2, 0, 8)
    payload = encode_kv(empty, codec)
    assert payload.shape == (2, layer_bytes(codec, 2, 0, 8))
    assert decode_kv(payload, codec, 2, 0, 8, torch.float32).shape == empty.shape


@pytest.mark.parametrize("codec", CODECS)
def test_one_layer_decodes_as_its_slice_of_all(codec):
    kv = kv_of()
    payload = encode_kv(kv, codec)
    whole = decode_kv(payload, codec, 3, 64, 64, torch.float32)
    assert torch.equal(decode_kv(payload[2:3], codec, 3, 64, 64, torch.float32)[0], whole[2])


def entry(i: int = 0, **kw) -> ChunkKV:
    return ChunkKV(f"{i:02d}" * 32, kv_of(seed=i, **kw), token_ids=tuple(range(kw.get("tokens", 64))))


def read_layers(store: ChunkStore, key: str) -> ChunkKV | None:
    reader = store.open_layers(key)
    if not isinstance(reader, LayerReader):
        return reader
    error = None
    try:
        for _ in range(reader.num_layers):
            reader.read_layer()
        reader.verify()
    except Exception as e:
        error = e
    return store.finish_layers(reader, error)


@pytest.mark.parametrize("codec", CODECS)
def test_every_tier_and_way_of_reading_gives_the_same_decoded_values(tmp_path, redis_url, codec):
    e = entry()
    with ChunkStore(tmp_path / "a", remote=redis_url, kv_codec=codec) as a:
        a.put(e)
        from_memory = a.get(e.key)
        assert from_memory.key == coded_key(e.key, codec)
        assert relative_error(from_memory.values(), e.kv) < 0.04  # the decoded values, not the ones put
        # memory holds the codes, as the shared tiers do: a quarter of the bytes
        assert from_memory.codec == codec and from_memory.nbytes < 0.3 * e.nbytes
        assert a.locate(e.key) == ("memory", from_memory.nbytes)
    with ChunkStore(tmp_path / "a", memory_limit_bytes=0, kv_codec=codec) as disk:
        from_disk, disk_layers = disk.get(e.key), read_layers(disk, e.key)
    with ChunkStore(tmp_path / "b", remote=redis_url, memory_limit_bytes=0, kv_codec=codec) as b:
        from_redis = read_layers(b, e.key)
        assert b.stats.remote_hits == 1
    for other in (from_disk, disk_layers, from_redis):
        assert same(other, from_memory)


def test_codecs_share_a_store_side_by_side(tmp_path):
    e = entry()
    stores = {codec: ChunkStore(tmp_path, kv_codec=codec) for codec in (None, *CODECS)}
    stores["int8"].put(e)
    assert e.key in stores["int8"]
    assert e.key not in stores[None] and e.key not in stores["fp8"]
    assert stores[None].get(e.key) is None  # a raw reader never takes int8 codes for its own
    stores[None].put(e)
    stores["fp8"].put(e)
    assert len(stores[None]) == 3
    assert torch.equal(ChunkStore(tmp_path, memory_limit_bytes=0).get(e.key).kv, e.kv)
    # every tier holds each codec's bytes
    sizes = {codec: ChunkStore(tmp_path, memory_limit_bytes=0, kv_codec=codec).locate(e.key).nbytes for codec in stores}
    assert sizes["int8"] < 0.3 * sizes[None] and sizes["fp8"] < 0.3 * sizes[None]


def test_reads_measure_the_codec_s_own_bytes(tmp_path):
    e = entry()
    with ChunkStore(tmp_path, kv_codec="int8") as a:
        a.put(e)
    with ChunkStore(tmp_path, memory_limit_bytes=0, kv_codec="int8") as disk:
        assert disk.get(e.key) is not None
        assert disk.stats.bytes_read == disk.locate(e.key).nbytes
        assert disk.stats.bytes_read == len(encode(ChunkKV(coded_key(e.key, "int8"), e.kv, e.token_ids)))
        assert disk.read_rates["disk"].samples == 1  # the rate the loading controller uses: int8 bytes per second


def forge(header: dict, payload: bytes) -> bytes:
    """An entry with this header and payload and a right checksum: damage
    (or a foreign writer) only the reader's own checks can see."""
    from blend_integrations.store.format import FORMAT_VERSION, MAGIC

    body = json.dumps(header).encode()
    body += b" " * (-(12 + len(body)) % 64)
    data = struct.pack("<4sII", MAGIC, FORMAT_VERSION, len(body)) + body + payload
    return data + struct.pack("<I", zlib.crc32(data))


def parts(raw: bytes) -> tuple[dict, bytes]:
    layout = read_layout(memoryview(raw), len(raw))
    return dict(layout.header), raw[layout.payload_start : -4]


@pytest.mark.parametrize(
    "damage",
    ["nan scale", "negative scale", "unknown codec", "int8 codes under an fp8 key", "raw bytes under an int8 key"],
)
@pytest.mark.parametrize("way", ["whole", "layers"])
def test_damaged_or_foreign_coded_entries_are_dropped_not_used(tmp_path, caplog, damage, way):
    e = entry(tokens=200)  # big enough to live in a file, so it is read layer by layer
    with ChunkStore(tmp_path, kv_codec="int8") as s:
        s.put(e)
    codec, key = "int8", coded_key(e.key, "int8")
    with diskcache.Cache(str(tmp_path)) as raw:
        header, payload = parts(bytes(raw[key]))
        if damage in ("nan scale", "negative scale"):  # the first layer's first K scale
            payload = struct.pack("<f", float("nan") if damage == "nan scale" else -1.0) + payload[4:]
        elif damage == "unknown codec":
            header["codec"] = "int4"
        elif damage == "int8 codes under an fp8 key":
            del raw[key]
            codec, key = "fp8", coded_key(e.key, "fp8")
            header["key"] = key
        else:
            header, payload = parts(encode(e))
            header["key"] = key
        raw[key] = forge(header, payload)
    with caplog.at_level(logging.WARNING), ChunkStore(tmp_path, memory_limit_bytes=0, kv_codec=codec) as s:
        got = s.get(e.key) if way == "whole" else read_layers(s, e.key)
        assert got is None
        assert s.stats.corrupt == 1
        assert e.key not in s  # dropped: the next use recomputes and stores it again
    assert "dropped corrupt entry" in caplog.text


def test_unknown_codec_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="unknown kv_codec 'int4'"):
        ChunkStore(tmp_path, kv_codec="int4")
    with pytest.raises(ValueError, match="unknown kv_codec 'int4'"):
        BlendConfig(kv_codec="int4")


def test_an_engine_s_store_keeps_the_config_s_codec(tmp_path):
    raw = ChunkStore(tmp_path)
    assert engine_store(raw, BlendConfig()) is raw
    coded = ChunkStore(tmp_path, kv_codec="int8")
    assert engine_store(coded, BlendConfig()) is coded  # the store's own codec
    assert engine_store(coded, BlendConfig(kv_codec="int8")) is coded
    with pytest.raises(ValueError, match=r"BlendConfig\(kv_codec='fp8'\), but the store given keeps chunks as 'int8'"):
        engine_store(coded, BlendConfig(kv_codec="fp8"))


def test_raw_stores_are_unchanged(tmp_path):
    """Entries of stores without a codec keep their keys and bytes: stores
    written before codecs stay valid."""
    e = make_entry(1)
    with ChunkStore(tmp_path) as s:
        s.put(e)
    with diskcache.Cache(str(tmp_path)) as raw:
        assert bytes(raw[e.key]) == encode(e)
