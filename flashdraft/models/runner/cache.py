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
writes the new tensor into the buffer and sets the length: the batch state works on this cache unchanged.

Rows come and go under continuous batching (a finished row leaves, the next prompt joins), so a buffer
keeps room for as many rows as it ever held: `k[i]` / `v[i]` are its first `rows` rows (contiguous
views), and a batch that shrinks and grows again writes into the room it had instead of allocating
(and zeroing) every layer's buffer anew at each join; datagen spent 5% of its time there.
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
        # The buffers' first `rows` rows, what every forward reads and writes (views of `_room`).
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self._room: dict[int, torch.Tensor] = {}  # whole buffers, by `_slot` (k[0..], then v[0..])
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
                    buf[i] = self._alloc(buf, i, batch, cap)
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

    # -- rows leave and join in place (continuous batching) ----------------------------------------

    def keep_rows(self, index: list[int]) -> None:
        """Only rows `index` (ascending) stay, moved up in place: the rows before the first one that
        leaves are not touched."""
        moved = [j for j, r in enumerate(index) if r != j]
        src = torch.tensor([index[j] for j in moved], dtype=torch.long, device=self.device)
        dst = torch.tensor(moved, dtype=torch.long, device=self.device)
        for buf in (self.k, self.v):
            for i, t in enumerate(buf):
                if t is None:
                    continue
                room = self._room[self._slot(buf, i)]
                if moved:
                    room[dst, :, : self.length] = room[src, :, : self.length]
                buf[i] = room[: len(index)]

    def append_rows(self, other: KVCache) -> bool:
        """`other`'s rows below these, in the room these buffers have, both padded with zeros (dead
        slots) to the longer; False (nothing done) where there is no room: the caller concatenates."""
        rows, more, length = self.k[0].shape[0], other.k[0].shape[0], max(self.length, other.length)
        if self._room[0].shape[0] < rows + more or self._room[0].shape[2] < length:
            return False
        for buf, new in ((self.k, other.k), (self.v, other.v)):
            for i in range(len(buf)):
                room = self._room[self._slot(buf, i)]
                room[:rows, :, self.length : length] = 0
                room[rows : rows + more, :, : other.length] = new[i][:, :, : other.length]
                room[rows : rows + more, :, other.length : length] = 0
                buf[i] = room[: rows + more]
        self.length = length
        return True

    # -- the DynamicCache-like view the engine edits ---------------------------------------------

    def _slot(self, buf: list, i: int) -> int:
        return i if buf is self.k else len(self.k) + i

    def view(self, buf: list, i: int) -> torch.Tensor | None:
        return None if buf[i] is None else buf[i][:, :, : self.filled[self._slot(buf, i)]]

    def assign(self, buf: list, i: int, t: torch.Tensor) -> None:
        """Write t (rows, kv_heads, slots, head_dim), a new tensor (never a view of this buffer), as
        buffer i: into the room it has, or a larger one."""
        rows, slots = t.shape[0], t.shape[2]
        room = self._room.get(self._slot(buf, i))
        if room is None or room.shape[0] < rows or room.shape[2] < slots:
            cap = max(CHUNK, 0 if room is None else room.shape[2])
            while cap < slots:
                cap *= 2
            self._alloc(buf, i, rows, cap)
        buf[i] = self._room[self._slot(buf, i)][:rows]
        buf[i][:, :, :slots] = t
        self.filled[self._slot(buf, i)] = slots

    def _alloc(self, buf: list, i: int, rows: int, cap: int) -> torch.Tensor:
        """A new buffer i of `cap` slots, with room for at least as many rows as the old one had;
        returns its first `rows` rows (the old contents are the caller's to copy)."""
        old = self._room.get(self._slot(buf, i))
        room_rows = max(rows, 0 if old is None else old.shape[0])
        room = torch.zeros(room_rows, self.shape[0], cap, self.shape[1], dtype=self.dtype, device=self.device)
        self._room[self._slot(buf, i)] = room
        return room[:rows]
