"""The runner's KV cache: one preallocated (B, kv_heads, capacity, head_dim) buffer per layer and for
keys and values, written in place at slot `length` onwards.

transformers' DynamicCache concatenates every step (a copy of the whole cache per layer and step);
here a step writes only its new slots, and the capacity grows by doubling when a forward would
overflow it, so copies are rare. Slots are not positions: rows of a batch may hold different
positions in the same slot (`flashdraft.models.batch.Slots` keeps them next to the cache, and the masks
come from them).

The batch state (`flashdraft.models.batch.TargetBatch`) edits caches through `layers[i].keys` /
`.values` (keep some rows, gather slots, merge a prefill's cache into the batch's), as it does with a
DynamicCache. Here those are views of the filled part of the buffers, and assigning one
writes the new tensor into the buffer (reallocating it only if the batch size or the capacity changes)
and sets the length: the batch state works on this cache unchanged.
"""

from __future__ import annotations

import torch

from flashdraft.models.runner import kernels

CHUNK = 256  # the smallest capacity, in slots


class _Layer:
    def __init__(self, cache: KVCache, i: int):
        self._cache, self._i = cache, i

    @property
    def keys(self) -> torch.Tensor | None:
        return self._cache.view(self._cache.k, self._i)

    @keys.setter
    def keys(self, t: torch.Tensor) -> None:
        self._cache.assign(self._cache.k, self._i, t)

    @property
    def values(self) -> torch.Tensor | None:
        return self._cache.view(self._cache.v, self._i)

    @values.setter
    def values(self, t: torch.Tensor) -> None:
        self._cache.assign(self._cache.v, self._i, t)


class KVCache:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device):
        self.shape = (kv_heads, head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        # Filled slots of each buffer (k[0..], then v[0..]): equal except in the middle of an edit by
        # the engine, which assigns the layers' keys and values one after the other.
        self.filled = [0] * (2 * num_layers)
        self.layers = [_Layer(self, i) for i in range(num_layers)]

    @property
    def length(self) -> int:
        return self.filled[0]

    @length.setter
    def length(self, n: int) -> None:
        self.filled = [n] * len(self.filled)

    @property
    def capacity(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[2]

    def get_seq_length(self) -> int:
        return self.length

    def reserve(self, batch: int, new: int) -> int:
        """Make room for `new` slots after the filled ones for `batch` rows; returns the first new slot."""
        need = self.length + new
        if self.k[0] is None or self.k[0].shape[0] != batch or need > self.capacity:
            if self.k[0] is not None and self.k[0].shape[0] != batch:
                raise ValueError(f"the cache holds {self.k[0].shape[0]} rows, the forward has {batch}")
            cap = max(CHUNK, self.capacity)
            while cap < need:
                cap *= 2
            for buf in (self.k, self.v):
                for i, old in enumerate(buf):
                    buf[i] = self._alloc(batch, cap)
                    if old is not None:
                        buf[i][:, :, : self.length] = old[:, :, : self.length]
        return self.length

    def write(
        self, i: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer i's new keys and values (B, kv_heads, T, D) at slots start.. and return the
        layer's keys and values up to them (views, no copy)."""
        end = start + k.shape[2]
        self.k[i][:, :, start:end] = k
        self.v[i][:, :, start:end] = v
        return self.k[i][:, :, :end], self.v[i][:, :, :end]

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def reorder(self, start: int, order: torch.Tensor) -> bool:
        """Row r's slots start.. take its slots start + order[r] (B, L), in every layer (a tree's accepted
        path moved to the front of its block), in one C++ call (`reorder_slots`) where our kernels are
        built; False where they are not, and the caller moves them (a gather per layer and tensor)."""
        if self.k[0] is None or not kernels.available():
            return False
        torch.ops.flashdraft.reorder_slots(self.k, self.v, start, order)
        return True

    # -- the DynamicCache-like view the engine edits ---------------------------------------------

    def _slot(self, buf: list, i: int) -> int:
        return i if buf is self.k else len(self.k) + i

    def view(self, buf: list, i: int) -> torch.Tensor | None:
        return None if buf[i] is None else buf[i][:, :, : self.filled[self._slot(buf, i)]]

    def assign(self, buf: list, i: int, t: torch.Tensor) -> None:
        old = buf[i]
        if old is None or old.shape[0] != t.shape[0] or old.shape[2] < t.shape[2]:
            cap = max(CHUNK, 0 if old is None else old.shape[2])
            while cap < t.shape[2]:
                cap *= 2
            buf[i] = self._alloc(t.shape[0], cap)
        buf[i][:, :, : t.shape[2]] = t
        self.filled[self._slot(buf, i)] = t.shape[2]

    def _alloc(self, batch: int, cap: int) -> torch.Tensor:
        return torch.zeros(batch, *self.shape[:1], cap, *self.shape[1:], dtype=self.dtype, device=self.device)
