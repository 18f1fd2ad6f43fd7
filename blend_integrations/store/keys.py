"""Store layer: content-addressed keys for stored chunk KV caches.

A key must change whenever anything that changes the stored bytes changes:
the recipe used to compute the KV, the model weights, the dtype, the BOS
token and the chunk's token ids. Everything here is engine-independent so
that HF, vLLM and any other engine sharing a store agree on keys.
"""

from __future__ import annotations

import hashlib
import operator
import os
import struct
import sys
from array import array
from collections.abc import Sequence
from pathlib import Path

# Chunk KV recipe, version 1: the chunk is prefilled standalone as
# ``[BOS] + chunk`` at positions 0..n (BOS at 0, the chunk's tokens at 1..n),
# the BOS row is dropped, and K is stored *before* RoPE so the consumer can
# rotate it to whatever positions the chunk lands at in the final prompt.
# Bump this string whenever any of that changes: old entries then simply
# stop matching instead of being reused wrongly.
RECIPE_VERSION = "chunk-kv-v1"

# Files whose bytes are the model's weights (top level of the checkpoint dir).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")

_FP_WINDOWS = 64
_FP_WINDOW_BYTES = 4096
_FP_DOMAIN = b"blend_integrations/model-fingerprint/v1"
_KEY_DOMAIN = b"blend_integrations/chunk-key/v1"


def _field(h: hashlib._Hash, data: bytes) -> None:
    """Feed one length-prefixed field so concatenations can't collide."""
    h.update(struct.pack("<Q", len(data)))
    h.update(data)


def model_fingerprint(model_dir: str | os.PathLike) -> str:
    """Return a hex digest identifying a checkpoint directory by content.

    The digest covers the bytes of ``config.json`` and, for every weight file
    (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, sorted by name), its
    name, its size and up to 64 windows of 4096 bytes read at evenly spaced
    offsets (first window at the start, last one at the very end). Files of
    at most 256 KiB are therefore read entirely.

    Why sampled: hashing a 15 GB checkpoint in full takes tens of seconds on
    every start-up; sampling costs ~256 KB of reads per file and still
    catches any realistic difference between checkpoints (different
    fine-tunes differ everywhere, and safetensors headers at offset 0 list
    every tensor's name, dtype and shape). It is not a defence against
    someone crafting two checkpoints that differ only between windows.

    Why conservative: the fingerprint is over bytes, not semantics, so a
    re-save that changes any sampled byte (other dtype, other shard layout,
    other serializer) yields a new fingerprint and the chunk cache is
    recomputed rather than wrongly reused. It does not depend on which
    engine loads the model.

    Raises:
        FileNotFoundError: no ``config.json`` or no weight file in
            ``model_dir`` (e.g. a hub repo id was passed instead of a local
            directory).
    """
    root = Path(model_dir)
    config = root / "config.json"
    if not config.is_file():
        raise FileNotFoundError(
            f"model_fingerprint: no config.json in {str(root)!r}; pass the local directory of a downloaded checkpoint"
        )
    weights = sorted((p for p in root.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()), key=lambda p: p.name)
    if not weights:
        raise FileNotFoundError(
            f"model_fingerprint: no weight file ({', '.join('*' + s for s in WEIGHT_SUFFIXES)}) in {str(root)!r}"
        )

    h = hashlib.sha256()
    _field(h, _FP_DOMAIN)
    _field(h, config.read_bytes())
    for path in weights:
        size = path.stat().st_size  # follows symlinks (HF cache snapshots)
        _field(h, path.name.encode("utf-8"))
        h.update(struct.pack("<Q", size))
        with open(path, "rb") as f:
            for offset in _window_offsets(size):
                f.seek(offset)
                _field(h, f.read(_FP_WINDOW_BYTES))
    return h.hexdigest()


def _window_offsets(size: int) -> list[int]:
    """Offsets of the sampled windows; contiguous (whole file) when small."""
    if size <= _FP_WINDOWS * _FP_WINDOW_BYTES:
        return list(range(0, size, _FP_WINDOW_BYTES))
    last = size - _FP_WINDOW_BYTES
    return [i * last // (_FP_WINDOWS - 1) for i in range(_FP_WINDOWS)]


def chunk_key(
    *, fingerprint: str, dtype: str, token_ids: Sequence[int], bos_token_id: int | None, recipe: str = RECIPE_VERSION
) -> str:
    """Return the store key (sha256 hex) of one chunk's KV cache.

    Hashes a length-prefixed encoding of ``recipe``, ``fingerprint`` (from
    :func:`model_fingerprint`), ``dtype`` (e.g. ``"bfloat16"``; a
    ``torch.dtype`` or ``"torch.bfloat16"`` is normalised to the same
    string), the BOS id (``"none"`` if None) and the token ids as
    little-endian int64. Any difference in these gives a different key.
    """
    if not isinstance(fingerprint, str) or not fingerprint:
        raise ValueError("chunk_key: fingerprint must be a non-empty str")
    if not isinstance(recipe, str) or not recipe:
        raise ValueError("chunk_key: recipe must be a non-empty str")
    dtype_name = str(dtype).removeprefix("torch.")
    if not dtype_name:
        raise ValueError("chunk_key: dtype must be a non-empty str such as 'float32'")
    if bos_token_id is None:
        bos = "none"
    else:
        bos = str(operator.index(bos_token_id))

    try:
        # operator.index rejects floats (int() would silently truncate them)
        # and accepts Python, numpy and 0-d torch integers.
        ids = array("q", (operator.index(t) for t in token_ids))
    except OverflowError as e:
        raise ValueError(f"chunk_key: token id out of int64 range: {e}") from None
    if sys.byteorder != "little":
        ids.byteswap()

    h = hashlib.sha256()
    _field(h, _KEY_DOMAIN)
    _field(h, recipe.encode("utf-8"))
    _field(h, fingerprint.encode("utf-8"))
    _field(h, dtype_name.encode("utf-8"))
    _field(h, bos.encode("utf-8"))
    _field(h, ids.tobytes())
    return h.hexdigest()


def coded_key(key: str, codec: str | None) -> str:
    """The key a store keeps ``key``'s entry under in ``codec`` (None: raw,
    the key itself). The codec is part of the key, so one store holds a
    chunk in several codecs side by side and a reader never takes an entry
    in another codec for its own."""
    return key if codec is None else f"{key}.{codec}"


def key_codec(stored_key: str) -> str | None:
    """The codec a stored key names (``coded_key``); None for a raw entry's."""
    _, dot, codec = stored_key.rpartition(".")
    return codec if dot else None
